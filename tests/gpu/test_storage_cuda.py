"""GearStorage on a GPU: the same batches as on the CPU, from pinned host or device memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)
try:
    from helpers import as_td  # tests/helpers.py, which imports torchrl
    from prioritized_agreement import check_prioritized_against_torchrl
    from tensordict import TensorDict
    from torchrl.data import RandomSampler, TensorDictReplayBuffer

    from gear_torchrl import GearSequenceSampler, GearStorage
except ImportError as err:  # the GPU machine needs the carried torchrl/tensordict wheels
    pytest.skip(
        f"torchrl/tensordict not importable here ({err}); carry their wheels (scripts/gpu_check.sh)",
        allow_module_level=True,
    )

ROOT = Path(__file__).resolve().parents[2]


def steps(n: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    done = torch.rand(n, 1, generator=g) < 0.05
    return TensorDict(
        {
            "obs": torch.randn(n, 33, generator=g),
            "pixels": torch.randint(0, 255, (n, 3, 7), generator=g, dtype=torch.uint8),
            "action": torch.randint(0, 5, (n,), generator=g),
            "flag": torch.rand(n, generator=g) < 0.5,
            "logits": torch.randn(n, 5, generator=g).bfloat16(),
            ("next", "done"): done,
        },
        [n],
    )


def assert_same(cuda_td, cpu_td):
    assert cuda_td.device.type == "cuda"
    for key in cpu_td.keys(True, True):
        got, want = cuda_td.get(key), cpu_td.get(key)
        assert got.is_cuda, key
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got.cpu(), want), key


def pair(memory: Literal["host", "device"], capacity=500, sampler=None):
    cpu = TensorDictReplayBuffer(storage=GearStorage(capacity), sampler=sampler() if sampler else None)
    gpu = TensorDictReplayBuffer(
        storage=GearStorage(capacity, device="cuda", memory=memory), sampler=sampler() if sampler else None
    )
    for i in range(4):
        data = steps(170, seed=i)
        cpu.extend(data)
        gpu.extend(data)
    return cpu, gpu


@pytest.mark.parametrize("memory", ["host", "device"])
def test_reads_match_the_cpu_storage(memory):
    cpu, gpu = pair(memory)
    for index in (torch.randint(0, 500, (1000,)), torch.arange(500).flip(0), torch.tensor([3, -1]), 7):
        assert_same(gpu.storage.get(index.cuda() if isinstance(index, torch.Tensor) else index), cpu.storage.get(index))
    assert gpu.storage.shard.columns[0].is_cuda == (memory == "device")


@pytest.mark.parametrize("memory", ["host", "device"])
def test_uniform_batches_come_back_on_the_gpu(memory):
    cpu, gpu = pair(memory, sampler=RandomSampler)
    torch.manual_seed(0)
    batch = gpu.sample(256)
    assert batch.device.type == "cuda"
    assert_same(batch, cpu.storage.get(batch["index"].cpu()))  # the stored "index" column is the sampled index


def test_sequence_windows_match_the_cpu_storage():
    cpu, gpu = pair("host", sampler=lambda: GearSequenceSampler(8, burn_in=2, strict_length=False))
    torch.manual_seed(3)
    want = cpu.sample(10 * 32)
    torch.manual_seed(3)
    got = gpu.sample(10 * 32)
    assert_same(got, want)


@pytest.mark.parametrize("sampler_device", ["cpu", "cuda"])
def test_prioritized_sampler_over_a_gpu_storage(sampler_device):
    check_prioritized_against_torchrl("cuda", sampler_device)


def test_checkpoint_round_trip_on_gpu(tmp_path):
    _, gpu = pair("host")
    gpu.dumps(tmp_path)
    restored = TensorDictReplayBuffer(storage=GearStorage(500, device="cuda", memory="device"))
    restored.loads(tmp_path)
    assert_same(restored.storage.get(slice(None)), gpu.storage.get(slice(None)).cpu())


def test_cupy_runtime_path_gives_the_same_batches():
    pytest.importorskip("cupy")
    script = (
        f"import torch, sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_storage_cuda import pair, assert_same\n"
        "from gear_torchrl.kernels import gather\n"
        "assert gather._use_cupy()\n"
        "cpu, gpu = pair('host')\n"
        "index = torch.randint(0, 500, (777,))\n"
        "assert_same(gpu.storage.get(index.cuda()), cpu.storage.get(index))\n"
        "print('cupy path ok')\n"
    )
    env = {**os.environ, "GEAR_TORCHRL_FORCE_CUPY": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cupy path ok" in out.stdout


def test_shared_store_is_read_on_the_gpu_by_every_process():
    """Each attaching process registers its own mapping of the segment; all read the same rows on the GPU."""
    import multiprocessing as mp

    from shared_gpu_workers import frames, read_on_the_gpu_then_write

    from gear_torchrl import TrajectoryWriter

    owner = GearStorage(1000, shared=True, device="cuda")
    rb = TensorDictReplayBuffer(storage=owner, batch_size=128)
    try:
        writer = TrajectoryWriter(owner)
        writer.extend(frames(0, 300))
        writer.end_episode()
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        child = ctx.Process(target=read_on_the_gpu_then_write, args=(owner, 300, results))
        child.start()
        status, same, written = results.get(timeout=120)
        child.join(timeout=60)
        assert status == "ok", same
        assert same is True and written == 40 and child.exitcode == 0
        assert len(owner) == 340
        everything = as_td(owner.get(torch.arange(340, device="cuda")))
        assert torch.equal(everything["obs"].cpu(), frames(0, 340)["obs"])  # the child's rows, read by the owner
        sample = rb.sample()
        assert sample["obs"].is_cuda
        assert torch.equal(sample["obs"].cpu(), frames(0, 340)["obs"][sample["step"].cpu()])
    finally:
        owner.close()
