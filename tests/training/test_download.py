"""--init sources download what they need when the network allows (training/init/download.py),
against a real HTTP server on loopback: the file lands in torch's hub cache only when its hash
matches the one its name carries, a wrong file is refused and not kept, and SNCA_OFFLINE=1
(or HF_HUB_OFFLINE=1) refuses before any request is made."""

import hashlib
import http.server
import threading

import pytest
import torch
import torchvision

from embedding.errors import SNCAError
from training.init import resolve
from training.init.download import fetch


class Files:
    """A loopback HTTP server answering GET /NAME from `files` (NAME -> bytes), counting."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.requests = files, []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.requests.append(self.path)
                body = outer.files.get(self.path.lstrip("/"))
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.fixture
def files():
    served = Files({})
    yield served
    served.close()


def test_a_published_file_is_downloaded_into_the_cache_with_its_hash_checked(files, tmp_path):
    body = torch.randn(1000).numpy().tobytes()
    name = f"tiny-{hashlib.sha256(body).hexdigest()[:8]}.pth"
    files.files[name] = body
    dest = tmp_path / "hub" / "checkpoints" / name
    assert fetch(f"{files.url}/{name}", dest, "test:tiny") == dest
    assert dest.read_bytes() == body and files.requests == [f"/{name}"]


def test_a_file_that_is_not_the_published_one_is_refused_and_not_kept(files, tmp_path, monkeypatch):
    """torchvision:resnet18 through a mirror (SNCA_WEIGHTS_MIRROR) that serves other bytes
    under the published name: the hash in the name does not match."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("SNCA_WEIGHTS_MIRROR", files.url)
    monkeypatch.delenv("SNCA_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    name = torchvision.models.ResNet18_Weights.DEFAULT.url.rsplit("/", 1)[1]
    files.files[name] = b"not the weights"
    with pytest.raises(SNCAError, match="is not the published file.*hash"):
        resolve("torchvision:resnet18")
    assert files.requests == [f"/{name}"]
    assert not (tmp_path / "torch" / "hub" / "checkpoints" / name).exists()
    with pytest.raises(SNCAError, match="downloading .* failed.*place it at"):
        files.files.clear()  # a 404
        resolve("torchvision:resnet18")


@pytest.mark.parametrize("flag", ["SNCA_OFFLINE", "HF_HUB_OFFLINE"])
def test_offline_refuses_before_any_request(files, tmp_path, monkeypatch, flag):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("SNCA_WEIGHTS_MIRROR", files.url)
    monkeypatch.setenv(flag, "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf"))
    with pytest.raises(SNCAError, match="downloads are off.*place it at"):
        resolve("torchvision:resnet18")
    with pytest.raises(SNCAError, match="downloads are off.*--init timm:resnet18:PATH"):
        resolve("timm:resnet18")
    assert files.requests == []
