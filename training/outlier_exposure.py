"""Synthetic outlier exposure inside the SNCA loss (Hendrycks et al. 2019; with generated
outliers as in Hein et al.'s CEDA, 2019; the norm term of Dhamija et al.'s objectosphere, 2018).

Each step, a share `ratio` of the batch is turned into outliers of the generated families
(embedding/outliers.py: noise, flat images, inverted, permuted-and-blurred, patch-shuffled,
mixtures; some families are held out and only measured). They go through the network with the
batch, are never positives of anything and never enter the memory bank. Their loss:

    uniform:  L_u(o) = logsumexp_k(l_ok) - (1/C) Σ_c logsumexp_{k∈c}(l_ok)
              = -(1/C) Σ_c log p(c | o),   l_ok = f_o·v_k / σ over the memory bank
              (the cross-entropy of o's neighbour distribution over classes, eq. 2 summed per
              class, with the uniform distribution: no class's neighbourhood claims it)
    norm:     L_n(o) = ||W·backbone(o)||² / d   (the projection before normalisation: small
              for what is not of the world, a statistic the world check reads)

    L = L_NCA(batch) + weight · mean_o (L_u(o) + norm_weight · L_n(o))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embedding import outliers


@dataclass
class OutlierExposure:
    weight: float  # of the outlier loss against the NCA loss
    ratio: float  # outliers per image of the batch
    families: tuple[str, ...]
    mean: torch.Tensor  # (1, C, 1, 1) the model card's normalisation
    std: torch.Tensor
    norm_weight: float = 0.1
    generator: torch.Generator | None = None

    @classmethod
    def create(cls, weight, ratio, families, model_cfg, seed: int) -> OutlierExposure:
        unknown = [f for f in families if f not in outliers.FAMILIES]
        if unknown:
            raise ValueError(
                f"unknown outlier families {', '.join(unknown)} (choose from "
                f"{', '.join(outliers.FAMILIES)})"
            )
        c = len(model_cfg.mean)
        return cls(
            weight,
            ratio,
            tuple(families),
            torch.tensor(model_cfg.mean).view(1, c, 1, 1),
            torch.tensor(model_cfg.std).view(1, c, 1, 1),
            generator=torch.Generator().manual_seed(seed + 7919),
        )

    def make(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised outliers (m, C, H, W) from a normalised batch x (B, C, H, W)."""
        m = max(1, round(self.ratio * x.shape[0]))
        src = x[:m].detach().cpu().float()
        u8 = ((src * self.std + self.mean) * 255.0).round().clamp(0, 255).to(torch.uint8)
        out = outliers.make(u8, self.families, self.generator)
        return ((out.float() / 255.0 - self.mean) / self.std).to(x.device, x.dtype)

    def loss(
        self,
        emb: torch.Tensor,
        proj_sq: torch.Tensor,
        memory: torch.Tensor,
        memory_labels: torch.Tensor,
        num_classes: int,
        temperature: float,
    ) -> torch.Tensor:
        """emb (m, d) unit outlier embeddings, proj_sq (m,) their squared projection norms / d;
        memory (N, d), memory_labels (N,). Scalar."""
        logits = emb.float() @ memory.float().t() / temperature  # (m, N)
        top = logits.max(dim=1, keepdim=True).values.detach()
        e = (logits - top).exp()  # (m, N) <= 1
        per_class = torch.zeros(len(emb), num_classes, dtype=e.dtype, device=e.device)
        per_class = per_class.scatter_add(1, memory_labels.expand(len(emb), -1), e)  # (m, C)
        have = torch.bincount(memory_labels, minlength=num_classes) > 0
        log_class = per_class[:, have].clamp(min=1e-30).log()  # (m, C') + top
        uniform = per_class.sum(dim=1).log() - log_class.mean(dim=1)  # L_u, top cancels
        return (uniform + self.norm_weight * proj_sq).mean()
