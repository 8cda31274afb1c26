"""ATTACH requests reach each backend's decoder exactly as the client sent them, through the
real daemon (socket, dispatch, access guard), with no GPU needed.

The cuda backend is served by its real class with only its device probe replaced (this
machine may have no GPU): its request decoding runs for real, so a well-formed cuda_ipc map
gets past decoding to the import, which refuses for want of a GPU (ATTACH_FAILED), never
BAD_FIELD; what the daemon knows about the asking peer travels beside the request."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cachexferd.backends import cpu as cpu_backend
from cachexferd.backends.cuda import backend as cuda_backend
from cachexferd.backends.cuda.backend import CudaBackend
from cachexferd.client.link import ClientError
from cachexferd.client.runner import RunnerClient, ShmKVCache
from cachexferd.host_cache import HostPool
from cachexferd.protocol import ErrorCode, KVLayout
from cachexferd.protocol.cuda_ipc import EVENT_HANDLE_BYTES, SharedStorage, TensorRef, encode_device

from ..helpers import SMALL, InProcessDaemon, config_for

FAKE_UUID = "GPU-0badcafe-0000-4000-8000-000000000001"


class ProbedCudaBackend(CudaBackend):
    """The cuda backend with its device probe replaced: it serves FAKE_UUID as device 0 and
    has no DMA binding; everything else (decoding, import, refusals) is the real code."""

    def _open_device(self, rank: int) -> None:
        self.uuids = [FAKE_UUID]
        self.device_index = 0
        self.device_uuid = FAKE_UUID
        self.device = torch.device("cuda", 0)
        self.device_name = "device probe replaced by the test"
        self.memcpy = None
        self.max_pitch = 0
        self.zero_copy = False

    def create_host_pool(self, capacity: int) -> HostPool:
        return HostPool(capacity)  # nothing to pin without a GPU


class CudaHandles:
    """A runner's cuda attach as a client sends it (built by the protocol's own encoder)."""

    def __init__(self, layout: KVLayout, extra: dict[str, Any] | None = None) -> None:
        self.layout = layout
        storage = SharedStorage(
            handle=bytes(range(64)), offset=0, size=layout.num_tensors * layout.tensor_bytes,
            ref_counter=b"/torch_4242_1_0", ref_counter_offset=3, event=bytes(EVENT_HANDLE_BYTES), event_sync=True,
        )  # fmt: skip
        refs = [TensorRef(0, t * layout.tensor_bytes) for t in range(layout.num_tensors)]
        self.map = {**encode_device(FAKE_UUID, [storage], refs), **(extra or {})}

    def device_handle(self) -> dict[str, Any]:
        return self.map


@pytest.fixture
def daemon_with(short_tmp: Path) -> Iterator[Callable[[str], InProcessDaemon]]:
    started: list[InProcessDaemon] = []

    def start(backend: str) -> InProcessDaemon:
        config = config_for(short_tmp / f"rt{len(started)}", daemon__backend=backend)
        make = (lambda: ProbedCudaBackend(config.cuda, 0)) if backend == "cuda" else None
        daemon = InProcessDaemon(config, make).start()
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()


def attach_error(endpoint: str, cache: Any) -> ClientError:
    with RunnerClient(endpoint, timeout_s=20) as runner, pytest.raises(ClientError) as info:
        runner.attach(cache)
    return info.value


def test_cuda_attach_gets_past_decoding_to_the_no_gpu_refusal(daemon_with: Callable[[str], InProcessDaemon]) -> None:
    daemon = daemon_with("cuda")
    error = attach_error(daemon.endpoint, CudaHandles(SMALL))
    assert error.code == ErrorCode.ATTACH_FAILED, error
    assert "cannot import the CUDA IPC handles" in error.detail
    if not torch.cuda.is_available():
        assert "CUDA" in error.detail  # torch's own words: compiled without CUDA / not available
    with RunnerClient(daemon.endpoint, timeout_s=20) as runner:
        assert runner.status()["device"]["state"] == "detached"  # and the daemon keeps serving


@pytest.mark.parametrize("backend", ["cpu", "cuda"], ids=["cpu-backend", "cuda-backend"])
@pytest.mark.parametrize("key", ["_segment_policy", "peer", "requester"])
def test_a_client_cannot_send_the_daemons_view_of_it(
    daemon_with: Callable[[str], InProcessDaemon], backend: str, key: str
) -> None:
    """Whatever a client adds to its device map is refused by the decoder, whose input is
    the client's map: the daemon's view of the peer never shares that map."""
    daemon = daemon_with(backend)
    forged = {key: {"peer": {"uid": 0, "gid": 0, "pid": 1}}}
    if backend == "cuda":
        cache: Any = CudaHandles(SMALL, forged)
        error = attach_error(daemon.endpoint, cache)
    else:
        with ShmKVCache(SMALL) as shm:
            cache = CudaHandles(SMALL)
            cache.map = {**shm.device_handle(), **forged}
            error = attach_error(daemon.endpoint, cache)
    assert error.code == ErrorCode.BAD_FIELD, error
    assert f"unknown fields ['{key}']" in error.detail


@pytest.mark.parametrize("backend", ["cpu", "cuda"], ids=["cpu-backend", "cuda-backend"])
def test_each_backends_decoder_is_fed_exactly_what_the_client_sent(
    daemon_with: Callable[[str], InProcessDaemon], backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module: Any = cuda_backend if backend == "cuda" else cpu_backend
    name = "decode_handles" if backend == "cuda" else "decode_device"
    real = getattr(module, name)
    fed: list[Any] = []

    def spy(device: Any) -> Any:
        fed.append(device)
        return real(device)

    monkeypatch.setattr(module, name, spy)
    daemon = daemon_with(backend)
    if backend == "cuda":
        cache: Any = CudaHandles(SMALL)
        sent = cache.device_handle()
        assert attach_error(daemon.endpoint, cache).code == ErrorCode.ATTACH_FAILED
    else:
        with ShmKVCache(SMALL) as cache, RunnerClient(daemon.endpoint, timeout_s=20) as runner:
            sent = cache.device_handle()
            assert runner.attach(cache)["state"] == "attached"
            runner.detach()
    assert fed == [sent], f"the {backend} decoder got {fed}, the client sent {sent}"
