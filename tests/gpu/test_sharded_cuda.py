"""A learner on a GPU reading a sharded store over tcp: batches in pinned memory, copied to the GPU intact."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
pytest.importorskip("torchrl", reason="torchrl not importable here: carry its wheels (scripts/gpu_check.sh)")


def test_pinned_sharded_batches_copy_to_the_gpu_intact():
    from shared_gpu_workers import pinned_sharded_rank

    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=pinned_sharded_rank, args=(rank, 2, port, results)) for rank in range(2)]
    for p in ranks:
        p.start()
    try:
        status, detail = results.get(timeout=180)
        assert status == "ok", detail
        assert detail == []
    finally:
        for p in ranks:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in ranks] == [0, 0]
