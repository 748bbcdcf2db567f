"""What checksums cost a restore: ``GearStorage.loads`` of a ~1.5 GiB store, verified against unverified.

One checkpoint is written, then a second manifest over the same column files
(hard links) in the format written before checksums, which loads without
verifying. Both restores run in turns into the same storage, the files in the
page cache: the CPU's cost alone, the worst case for the checksums' share (a
read from disk only adds time to both). The peer, TorchRL's ``LazyTensorStorage``
loading its own checkpoint of the same rows (memory-mapped files, no checksum),
takes the same turns. Also reported: how fast each candidate hash runs over one
buffer on this CPU, the reason XXH3 was chosen.

    .venv/bin/python benchmarks/checkpoint_restore.py [--gib 1.5] [--repeats 7] \
        [--out docs/results/checkpoint_restore.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
import warnings
import zlib
from pathlib import Path

import torch
import xxhash
from harness import interleaved_medians, write_json
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage

from gear_torchrl import GearStorage
from gear_torchrl.errors import UnverifiedCheckpointWarning

FRAME = (4, 84, 84)  # Atari-sized observations: most of the bytes
CHUNK = 8 << 20


def filled_store(gib: float) -> GearStorage:
    """A store of about ``gib`` GiB of random rows with episodes."""
    row_bytes = 2 * torch.Size(FRAME).numel() + 8 + 4 + 2
    rows = int(gib * (1 << 30)) // row_bytes
    storage = GearStorage(rows)
    g = torch.Generator().manual_seed(0)
    for first in range(0, rows, 4096):
        n = min(4096, rows - first)
        storage.set(
            torch.arange(first, first + n),
            TensorDict(
                {
                    "pixels": torch.randint(0, 256, (n, *FRAME), dtype=torch.uint8, generator=g),
                    "next": {
                        "pixels": torch.randint(0, 256, (n, *FRAME), dtype=torch.uint8, generator=g),
                        "reward": torch.randn(n, generator=g),
                        "done": torch.rand(n, 1, generator=g) < 0.001,
                    },
                    "action": torch.randint(0, 18, (n,), dtype=torch.int64, generator=g),
                },
                [n],
            ),
        )
    return storage


def unverified_copy(source: Path, target: Path) -> None:
    """``source``'s checkpoint as gear_torchrl wrote it before checksums, sharing its column files."""
    target.mkdir()
    for f in source.glob("*.bin"):
        os.link(f, target / f.name)
    manifest = json.loads((source / "shard.json").read_text())
    manifest["format"] = "gear_torchrl.shard/1"
    for key in ("checksum", "compacted"):
        manifest.pop(key)
    for meta in manifest["tensors"].values():
        meta.pop("checksum")
    (target / "shard.json").write_text(json.dumps(manifest))


def hash_rates(nbytes: int = 256 << 20) -> dict[str, float]:
    """GB/s of each candidate over one buffer, chunk by chunk as the loader hashes."""
    view = memoryview(os.urandom(nbytes))
    chunks = [view[i : i + CHUNK] for i in range(0, nbytes, CHUNK)]

    def streaming(update, start):
        def run():
            state = start
            for c in chunks:
                state = update(c, state)

        return run

    def hashlib_run(name):
        def run():
            h = hashlib.new(name)
            for c in chunks:
                h.update(c)

        return run

    def xxh3_run():
        digest = xxhash.xxh3_64()
        for c in chunks:
            digest.update(c)

    candidates = {
        "xxh3_64": xxh3_run,
        "crc32": streaming(zlib.crc32, 0),
        "adler32": streaming(zlib.adler32, 1),
        **{name: hashlib_run(name) for name in ("sha256", "blake2b", "sha1")},
    }
    rates = {}
    for name, run in candidates.items():
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        rates[name] = round(nbytes / best / 1e9, 2)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.5)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    source = filled_store(args.gib)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        verified, unverified = Path(tmp) / "verified", Path(tmp) / "unverified"
        source.dumps(verified)
        unverified_copy(verified, unverified)
        peer_path = Path(tmp) / "torchrl"
        peer = LazyTensorStorage(source.max_size)
        peer.set(torch.arange(len(source)), source[:])
        peer.dumps(peer_path)
        target = GearStorage(source.max_size)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnverifiedCheckpointWarning)
            times = interleaved_medians(
                {
                    "checksummed": lambda: target.loads(verified),
                    "unverified": lambda: target.loads(unverified),
                    "torchrl": lambda: peer.loads(peer_path),
                    # a TorchRL checkpoint moved to gear (its layout read,
                    # the episode index rebuilt)
                    "torchrl_into_gear": lambda: target.loads(peer_path),
                },
                repeats=args.repeats,
                inner=1,
                warmup=1,
            )
        assert len(target) == len(source) == len(peer)
    nbytes = source.shard.nbytes
    result = {
        "store_bytes": nbytes,
        "rows": len(source),
        "restore_s": {name: round(t, 4) for name, t in times.items()},
        "restore_GBps": {name: round(nbytes / t / 1e9, 2) for name, t in times.items()},
        "ratio_checksummed_over_unverified": round(times["checksummed"] / times["unverified"], 3),
        "ratio_checksummed_over_torchrl": round(times["checksummed"] / times["torchrl"], 3),
        "ratio_torchrl_into_gear_over_torchrl": round(times["torchrl_into_gear"] / times["torchrl"], 3),
        "hash_GBps": hash_rates(),
        "note": "files in the page cache; medians of interleaved runs",
    }
    print(json.dumps(result, indent=1))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
