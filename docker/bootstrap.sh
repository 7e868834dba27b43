#!/bin/sh
# One-shot bootstrap job of docker-compose.yml: when the volume has no model and index yet,
# train the default Fashion-MNIST model and build its index; otherwise do nothing. Idempotent:
# a run dir and an index dir only appear when complete (both are written under a temporary
# name and renamed), so an interrupted bootstrap simply runs again on the next `up`.
#
# Environment (all optional):
#   SNCA_MODEL          run dir to create                      (/data/models/default)
#   SNCA_INDEX          index dir to create                    (SNCA_MODEL/index)
#   SNCA_DATASETS       where datasets are looked for / downloaded to (/datasets); mount the
#                       Debian package dir (/usr/share/datasets) here to skip the download
#   SNCA_BOOTSTRAP_ARGS training flags        (--dataset fashion-mnist --arch conv4 --loss nca --epochs 3)
#   SNCA_INDEX_ARGS     snca-build-index flags (none: exact Flat index, training images re-embedded)
#   SNCA_DEVICE         auto | cpu | cuda (training and index building)
#   SNCA_RETRAIN        non-empty: train again (replacing the model) and rebuild the index; the
#                       service carries the gallery to the new model on its next start
#
# The index builder reads the training images again (thumbnails, --source recompute) from the
# folder the run recorded in its dataset.json, so it never looks in SNCA_DATA_DIR (the
# service's gallery volume) and never downloads the dataset a second time.
set -eu
model=${SNCA_MODEL:-/data/models/default}
index=${SNCA_INDEX:-$model/index}
device=${SNCA_DEVICE:-auto}
train_args=${SNCA_BOOTSTRAP_ARGS:---dataset fashion-mnist --arch conv4 --loss nca --epochs 3}

if [ -z "${SNCA_RETRAIN:-}" ] && [ -f "$model/model.json" ] && [ -f "$index/manifest.json" ]; then
    echo "bootstrap: $model and $index exist; nothing to do"
    exit 0
fi
if [ -n "${SNCA_RETRAIN:-}" ] || [ ! -f "$model/model.json" ]; then
    echo "bootstrap: training $model ($train_args, device $device)"
    # SNCA_DATA_DIR is the dataset root for the trainer (the service uses the same name for its
    # own data dir, hence set here only, for this one command).
    # shellcheck disable=SC2086
    SNCA_DATA_DIR=${SNCA_DATASETS:-/datasets} snca-train $train_args --device "$device" \
        --no-progress --out "$model" --overwrite
fi
echo "bootstrap: building the index $index"
# shellcheck disable=SC2086
snca-build-index "$model" --out "$index" --device "$device" --no-progress --reuse ${SNCA_INDEX_ARGS:-}
echo "bootstrap: done"
