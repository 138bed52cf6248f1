# megatron-zb on NVIDIA's PyTorch image: CUDA, NCCL, torch, Transformer Engine, apex and
# flash-attn come with the image, built and tested together; this file adds only megatron-core,
# megatron-zb and (optionally) a patched Megatron-LM checkout.
#
#   docker build -t megatron-zb:0.1.0 .
#   docker build -t megatron-zb:0.1.0 --build-arg MEGATRON_LM_REF= .    # without Megatron-LM
#
# scripts/slurm/*.sbatch run this image (MEGATRON_ZB_IMAGE, default megatron-zb:0.1.0).
#
# 25.12 (torch 2.10.0a0, CUDA 13.1, Python 3.12) is the last 2025 release: megatron-core 0.16
# needs torch >= 2.6 and is released against the previous month's NGC image. Pinned to one tag
# so every build gets the same torch/TE/NCCL; change it deliberately, never to `latest`.
FROM nvcr.io/nvidia/pytorch:25.12-py3

# pip must never replace the image's torch: it is NVIDIA's own build (a pre-release version such
# as 2.10.0a0+..., linked against the image's CUDA and NCCL), and a torch from the package index would silently
# drop those. The image keeps PIP_CONSTRAINT=/etc/pip/constraint.txt, which pins its packages;
# never unset it. Also, no `pip install apex`: the package index's "apex" is an unrelated package, and
# NVIDIA apex is already here. The torch version is recorded now and compared after the installs.
RUN python -c "import importlib.metadata as m; print(m.version('torch'))" > /opt/torch-version

# megatron-core pinned: megatron-zb's runtime is tested against 0.16.1. --no-deps because its
# only requirements (torch, numpy, packaging) are the image's, so pip has nothing to resolve.
RUN python -m pip install --no-cache-dir --no-deps megatron-core==0.16.1

# Optional: Megatron-LM's pretrain_gpt.py (real datasets, its logging and checkpoints) at the tag
# that matches megatron-core, patched below to call megatron_zb.install(). Empty: skip it.
ARG MEGATRON_LM_REF=core_v0.16.1
RUN if [ -n "${MEGATRON_LM_REF}" ]; then \
        git clone --depth 1 --branch "${MEGATRON_LM_REF}" https://github.com/NVIDIA/Megatron-LM.git /opt/Megatron-LM; \
    fi

# This package, from the build context (.dockerignore leaves out .venv, .git and outputs). It has
# no install requirements; --no-deps keeps it that way even if someone adds an extra here.
COPY . /opt/megatron-zb
RUN python -m pip install --no-cache-dir --no-deps /opt/megatron-zb

# apply.sh needs GNU patch (NGC images normally have it) and exits non-zero, failing the build,
# when the patch does not apply to this checkout.
RUN if [ -d /opt/Megatron-LM ]; then \
        command -v patch >/dev/null || (apt-get update && apt-get install -y --no-install-recommends patch); \
        bash /opt/megatron-zb/patches/apply.sh /opt/Megatron-LM; \
    fi

# Fail the build if any install above replaced the image's torch.
RUN test "$(python -c "import importlib.metadata as m; print(m.version('torch'))")" = "$(cat /opt/torch-version)" \
    || { echo "pip replaced the image's torch $(cat /opt/torch-version); keep PIP_CONSTRAINT and --no-deps" >&2; exit 1; }

# `megatron-zb train --megatron-lm` finds the checkout here (absent when MEGATRON_LM_REF is empty,
# and then that flag says so). Megatron needs one CUDA connection per device so that its
# communication kernels are queued in issue order (tensor/sequence-parallel overlap).
ENV MEGATRON_LM_PATH=/opt/Megatron-LM \
    CUDA_DEVICE_MAX_CONNECTIONS=1
WORKDIR /workspace
