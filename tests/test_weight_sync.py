"""weight_sync: the config section, the bucket layout, and real gloo transfers between two processes."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

import pytest
import torch

from trajflow.operators.weight_sync import (CollectiveChannel, InProcessChannel, WeightSyncConfig, WeightSyncError,
                                            backend_for, bucket_layout, payload_bytes)
from trajflow.pipelines.config import PipelineConfig
from trajflow.settings import SettingError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny transformer's state dict (real model, random init)."""
    from trajflow.engines.models import build_tiny_model

    model, _ = build_tiny_model(seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_config_section_defaults_and_bounds():
    config = PipelineConfig()
    assert config.weight_sync.spec() == WeightSyncConfig()
    assert config.weight_sync.method == "object_store"
    assert PipelineConfig(weight_sync={"bucket_mb": 1}).weight_sync.spec().bucket_mb == 1.0
    with pytest.raises(ValueError, match="weight_sync.method: collective is not wired"):
        PipelineConfig(weight_sync={"method": "collective"})
    with pytest.raises(ValueError, match="bucket_mb"):
        PipelineConfig(weight_sync={"bucket_mb": 0})
    with pytest.raises(ValueError, match="method"):
        PipelineConfig(weight_sync={"method": "nixl"})
    with pytest.raises(SettingError):
        WeightSyncConfig(timeout_seconds=-1.0)


def test_bucket_layout_respects_size_and_order():
    weights = {"a": torch.zeros(10), "b": torch.zeros(20), "c": torch.zeros(100), "d": torch.zeros(5)}
    layout = bucket_layout(weights, bucket_bytes=30 * 4, element_size=4)
    # a+b fill 120 bytes; c (400 bytes) exceeds a bucket and travels alone; d starts a new one
    assert [[t.name for t in b.tensors] for b in layout] == [["a", "b"], ["c"], ["d"]]
    assert [b.numel for b in layout] == [30, 100, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_process_channel_equals_object_store_cast(dtype):
    weights = _weights()
    channel = InProcessChannel(dtype, bucket_mb=0.01)
    channel.send(3, weights)
    got = channel.receive(3, weights)
    assert list(got) == list(weights)
    for name, tensor in weights.items():
        assert got[name].dtype == dtype
        assert torch.equal(got[name], tensor.to(dtype)), name  # bitwise: the reader's own cast
    assert payload_bytes(weights, torch.bfloat16) * 2 == payload_bytes(weights, torch.float32)


def _reader(port: int, prefix: str, dtype_name: str, version: int, queue) -> None:
    weights = _weights()
    dtype = getattr(torch, dtype_name)
    channel = CollectiveChannel(rank=1, port=port, prefix=prefix, dtype=dtype, bucket_mb=0.01, timeout_seconds=20)
    got = channel.receive(version, {k: torch.empty_like(v) for k, v in weights.items()})
    queue.put({name: bool(torch.equal(got[name], t.to(dtype))) and got[name].dtype == dtype
               for name, t in weights.items()})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_gloo_channel_delivers_bitwise_the_object_store_weights_in_reader_dtype(dtype_name):
    ctx = mp.get_context("spawn")
    port, queue = _free_port(), ctx.Queue()
    reader = ctx.Process(target=_reader, args=(port, "reader0/0", dtype_name, 7, queue))
    reader.start()
    try:
        channel = CollectiveChannel(rank=0, port=port, prefix="reader0/0", dtype=getattr(torch, dtype_name),
                                    bucket_mb=0.01, timeout_seconds=20)
        channel.send(7, _weights())
        result = queue.get(timeout=60)
    finally:
        reader.join(timeout=30)
    assert result and all(result.values()), [k for k, ok in result.items() if not ok]
    assert reader.exitcode == 0


def _dying_reader(port: int, prefix: str) -> None:
    weights = _weights()
    channel = CollectiveChannel(rank=1, port=port, prefix=prefix, dtype=torch.float32, bucket_mb=0.01,
                                timeout_seconds=20)
    first = bucket_layout(weights, int(0.01 * 2**20), 4)[0]
    # take the header and the first bucket only (a reader expecting just its tensors), then die
    channel.receive(1, {t.name: weights[t.name] for t in first.tensors})
    import os

    os._exit(1)


@pytest.mark.timeout(120)
def test_reader_killed_mid_transfer_is_one_line_not_a_hang():
    assert len(bucket_layout(_weights(), int(0.01 * 2**20), 4)) > 2  # the reader dies between buckets
    ctx = mp.get_context("spawn")
    port = _free_port()
    reader = ctx.Process(target=_dying_reader, args=(port, "reader0/0"))
    reader.start()
    channel = CollectiveChannel(rank=0, port=port, prefix="reader0/0", dtype=torch.float32, bucket_mb=0.01,
                                timeout_seconds=10)
    start = time.monotonic()
    with pytest.raises(WeightSyncError) as info:
        channel.send(1, _weights())
    reader.join(timeout=30)
    message = str(info.value)
    assert message.startswith("trajflow: weight_sync (reader0/0, trainer side):") and "\n" not in message
    assert time.monotonic() - start < 60


@pytest.mark.timeout(60)
def test_reader_that_never_joins_times_out_with_one_line():
    with pytest.raises(WeightSyncError) as info:
        CollectiveChannel(rank=0, port=_free_port(), prefix="lost/0", dtype=torch.float32, bucket_mb=1,
                          timeout_seconds=2).send(0, {"w": torch.zeros(4)})
    assert str(info.value).startswith("trajflow: weight_sync (lost/0, trainer side):")
    assert "\n" not in str(info.value)


def test_backend_choice_nccl_on_cuda_gloo_on_cpu_mock_named_no_gpu_needed():
    assert backend_for("cuda:0") == "nccl"
    assert backend_for("cpu") == "gloo"
