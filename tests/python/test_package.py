"""The Python package: HiCache from one config, stores on their own, errors, metrics."""
import json
import threading

import pytest

torch = pytest.importorskip("torch", reason="python3-torch is not installed")

import hicache

MODEL = {"layers": 2, "kv_heads": 1, "head_dim": 8}


def small_config(**extra):
    return {"device": "host", "page_size": 4, "device_tokens": 256, "model": MODEL, **extra}


def test_hicache_from_a_dict_and_from_a_json_file_is_the_same_cache(tmp_path):
    cfg = small_config(model_name="m", storage={"backend": "file", "root": str(tmp_path / "l3")})
    path = tmp_path / "hicache.json"
    path.write_text(json.dumps(cfg))
    with hicache.HiCache(cfg) as a:
        prefix = a.key_prefix
        assert a.page_size == 4 and a.device_tokens == 256 and a.host_tokens == 512
        assert a.store is not None and a.store.name == "file"
    with hicache.HiCache(str(path)) as b:
        assert b.key_prefix == prefix == "m.unversioned.fp16.layer_first.p4.tp0of1"


def test_l3_is_detached_attached_and_cleared_at_run_time(tmp_path):
    cfg = small_config(storage={"backend": "file", "root": str(tmp_path / "first")})
    with hicache.HiCache(cfg) as c:
        c.detach_storage()
        assert c.store is None
        c.detach_storage()  # nothing attached: nothing happens
        with pytest.raises(OSError, match="blocker"):
            (tmp_path / "blocker").write_text("x")
            c.attach_storage({"backend": "file", "root": str(tmp_path / "blocker")})
        assert c.store is None
        c.attach_storage({"backend": "file", "root": str(tmp_path / "second")})
        assert c.store is not None and (tmp_path / "second").is_dir()
        with pytest.raises(RuntimeError, match="attached already"):
            c.attach_storage(hicache.open_store({"backend": "file", "root": str(tmp_path / "x")}))
        page = torch.arange(16, dtype=torch.uint8)
        assert all(c.store.batch_set(["k-1"], [page]))
        c.clear_storage()
        assert c.store.batch_exists(["k-1"]) == 0
        c.detach_storage()
        own = hicache.open_store({"backend": "file", "root": str(tmp_path / "third")})
        c.attach_storage(own)
        assert c.store is own


HYBRID = {"device": "host", "page_size": 4, "device_tokens": 64,
          "model": {"layers": 2, "kv_heads": 1, "head_dim": 8},
          "sidecars": {"state": {"policy": "trailing", "layers": 3, "slot_bytes": 64,
                                 "dtype": "fp32", "device_pages": 4, "host_pages": 8},
                       "index": {"policy": "all_pages", "slots_per_page": 4, "slot_bytes": 16,
                                 "device_pages": 16, "host_pages": 32}}}


def test_sidecar_pools_wrap_the_engines_tensors_and_move_with_the_kv():
    """A hybrid model's state and indexer keys as the engine's torch tensors (SGLang's order:
    layers, slots, 1, elements): written to the host with the KV in one op, evicted with it,
    loaded back into other slots, byte for byte in the engine's own tensors."""
    state = torch.zeros((3, 4, 1, 16), dtype=torch.float32)      # 4 checkpoints of 3 layers
    index = torch.zeros((1, 16 * 4, 1, 8), dtype=torch.bfloat16)  # 16 pages of 4 slots
    state.normal_()
    index.view(torch.int16).random_(-30000, 30000)
    with hicache.HiCache(HYBRID, sidecars={"state": state, "index": index}) as c:
        assert c.sidecar_names == ["index", "state"]
        kv = c.alloc_device(2 * 4)
        st = c.sidecar_alloc_device("state", 1)        # the checkpoint after page 1
        ix = c.sidecar_alloc_device("index", 2)        # both pages' keys
        written_state, written_index = state.clone(), index.clone()
        host, side_host = c.write(kv, 1, sidecars={"state": st, "index": ix})
        assert c.wait_acks("write", 1) == [(1, True)]
        assert sorted(side_host) == ["index", "state"] and len(side_host["index"]) == 8
        c.evict_device(kv, host, sidecars={"state": (side_host["state"], st),
                                           "index": (side_host["index"], ix)})
        state.zero_()
        index.zero_()
        kv2, st2, ix2 = c.alloc_device(8), c.sidecar_alloc_device("state", 1), \
            c.sidecar_alloc_device("index", 2)
        assert c.load_into(host, kv2, 2, sidecars={"state": (side_host["state"], st2),
                                                   "index": (side_host["index"], ix2)})
        counter = c.start_loading()
        assert c.wait_for_layer(0)  # the sidecar pages land before layer 0 is done
        assert torch.equal(state[:, st2[0]], written_state[:, st[0]])
        for a, b in zip(ix2, ix):
            assert torch.equal(index[:, a].view(torch.int16), written_index[:, b].view(torch.int16))
        assert c.wait_for_layer(1)
        c.release_loading(counter)
        assert c.wait_acks("load", 1) == [(2, True)]
        # The sidecar bytes apart from the KV's: 1 state page (3 x 64 B) + 2 index pages (64 B).
        lines = [line for line in c.metrics_text().splitlines()
                 if line.startswith("hicache_sidecar_bytes_total{")]
        written = [float(line.split()[-1]) for line in lines if 'direction="l1_to_l2"' in line]
        assert written == [3 * 64 + 2 * 64], lines


def test_bad_sidecar_arguments_are_value_errors_naming_them():
    with pytest.raises(ValueError, match="sidecar pool 'state': the engine's device buffer is "
                                         "256 bytes; it must be 768 bytes"):
        hicache.HiCache(HYBRID, sidecars={"state": torch.zeros(64, dtype=torch.float32)})
    with pytest.raises(ValueError, match="device memory for sidecar pool 'mamba', which the "
                                         "config does not declare"):
        hicache.HiCache(HYBRID, sidecars={"mamba": torch.zeros(4)})
    with hicache.HiCache(HYBRID) as c:  # the pools allocate their own memory
        kv = c.alloc_device(4)
        with pytest.raises(ValueError, match="no sidecar pool 'mamba'"):
            c.write(kv, 1, sidecars={"mamba": [0]})
        assert c._c.host_free_tokens == c.host_tokens, "nothing reserved by a refused write"


def test_a_bad_config_is_a_value_error_naming_the_key_and_value():
    with pytest.raises(ValueError, match="unknown key 'hostratio'; did you mean 'host_ratio'"):
        hicache.HiCache(small_config(hostratio=1))
    with pytest.raises(ValueError, match="page_size"):
        hicache.HiCache(small_config(page_size=0))
    with pytest.raises(ValueError, match="host pool"):
        hicache.HiCache(small_config(host_ratio=0.5))
    with pytest.raises(TypeError, match="a dict or a path"):
        hicache.HiCache(42)
    with pytest.raises(OSError, match="cannot read"):
        hicache.HiCache("/nonexistent/hicache.json")
    with pytest.raises(ValueError, match="valid backends"):
        hicache.open_store({"backend": "nope"})


def test_a_store_directory_that_cannot_be_created_is_an_os_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match="cannot be created"):
        hicache.open_store({"backend": "file", "root": str(blocker / "store")})


def test_metrics_are_a_dict_and_prometheus_text():
    with hicache.HiCache(small_config()) as c:
        m = c.metrics()
        assert m["hicache_pool_capacity_tokens"]["type"] == "gauge"
        text = c.metrics_text()
        assert '# TYPE hicache_ops_total counter' in text
        assert 'hicache_pool_capacity_tokens{tp_rank="0",tier="device"} 256' in text


def test_close_is_idempotent_and_a_closed_cache_refuses_work():
    c = hicache.HiCache(small_config())
    c.close()
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.metrics()


def test_a_store_moves_tensors_and_buffers_in_place_byte_for_byte(tmp_path):
    s = hicache.open_store({"backend": "file", "root": str(tmp_path)})
    t = torch.randint(-1000, 1000, (4096,), dtype=torch.int32)
    b = bytearray(b"\x07" * 1000)
    res = s.batch_set(["t", "b"], [t, b])
    assert [r.status for r in res] == ["ok", "ok"] and all(res)
    out_t, out_b = torch.zeros_like(t), bytearray(1000)
    res = s.batch_get(["t", "b", "absent"], [out_t, out_b, bytearray(8)])
    assert [r.status for r in res] == ["ok", "ok", "miss"]
    assert torch.equal(out_t, t) and out_b == b
    assert s.batch_exists(["t", "b", "absent", "t"]) == 2
    st = s.stats()
    assert st["get_hits"] == 2 and st["set_written"] == 2
    # A buffer of another size than the record is a miss, never a partial read (and the
    # record, which does not match what its reader expects, is dropped).
    short = torch.full((10,), 5, dtype=torch.int32)
    assert s.batch_get(["t"], [short])[0].status == "miss"
    assert s.batch_exists(["t"]) == 0
    assert s.remove("b") and not s.remove("b")
    assert s.batch_set(["c"], [b"abc"])[0].ok
    s.clear()
    assert s.batch_exists(["c"]) == 0


def test_bad_buffers_and_bad_keys_are_value_errors_and_write_nothing(tmp_path):
    s = hicache.open_store({"backend": "file", "root": str(tmp_path)})
    with pytest.raises(ValueError, match="not contiguous"):
        s.batch_set(["k"], [torch.zeros(8, 8)[:, 0]])
    with pytest.raises(ValueError, match="neither a tensor nor"):
        s.batch_set(["k"], [12])
    with pytest.raises(ValueError, match="1 keys but 2 buffers"):
        s.batch_set(["k"], [bytearray(4), bytearray(4)])
    with pytest.raises(ValueError, match="bad storage key"):
        s.batch_set(["a/b"], [bytearray(4)])
    with pytest.raises(ValueError, match="buffer 0 .read into.: .*not writable"):
        s.batch_get(["k"], [b"immutable"])
    assert s.stats()["sets"] == 0


def test_the_gil_is_released_during_io(tmp_path):
    # Four Python threads write and read concurrently; with the GIL held across the I/O they
    # would still finish, so this checks the bytes under concurrency (the benchmark in
    # tools/python_store_bench.py measures the scaling).
    s = hicache.open_store({"backend": "file", "root": str(tmp_path), "io_threads": 2})
    errors = []

    def worker(n):
        try:
            pages = [torch.full((16384,), n * 100 + i, dtype=torch.int32) for i in range(8)]
            keys = [f"w{n}-{i}" for i in range(8)]
            assert all(s.batch_set(keys, pages))
            outs = [torch.zeros(16384, dtype=torch.int32) for _ in range(8)]
            assert all(s.batch_get(keys, outs))
            assert all(torch.equal(a, b) for a, b in zip(outs, pages))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_config_reference_comes_from_the_schema():
    ref = hicache.config_reference()
    assert "| key | flag |" in ref and "prefetch_threshold_tokens" in ref


def _load_back(c, host_slots, into, layers):
    """Loads host_slots into `into` (node 2) as the forward pass would, every layer waited for."""
    assert c.load_into(host_slots, into, 2)
    counter = c.start_loading()
    assert all(c.wait_for_layer(layer) for layer in range(layers))
    c.release_loading(counter)
    assert c.wait_acks("load", 1) == [(2, True)]


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("backend", ["host", "cuda"])
def test_the_engines_torch_tensors_are_the_pools_memory(layout, mla, backend):
    """Device and host KV as torch tensors in SGLang's shapes: a page written to the host and
    loaded back into slots the engine chose lands where SGLang's indexing reads it, in the
    engine's own tensors (host backend: "device" memory is host memory; CUDA: the device
    tensor is torch-allocated GPU memory)."""
    if backend == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU for torch here (python3-torch is CPU-only, or no device): the "
                    "CUDA case of the engine's tensors is not run")
    L, P, S_dev, S_host = 3, 4, 64, 128
    H, D = (1, 32) if mla else (2, 8)
    model = ({"attention": "mla", "layers": L, "kv_lora_rank": 24, "qk_rope_head_dim": 8}
             if mla else {"layers": L, "kv_heads": H, "head_dim": D})
    model["dtype"] = "bf16"
    cfg = {"device": backend, "page_size": P, "device_tokens": S_dev, "host_tokens": S_host,
           "host_layout": layout, "io_backend": "kernel", "model": model, "metrics": False}
    where = "cuda" if backend == "cuda" else "cpu"
    if mla:
        dev = torch.zeros((L, S_dev, 1, D), dtype=torch.bfloat16, device=where)
        host = torch.zeros({"layer_first": (L, S_host, 1, D), "page_first": (S_host, L, 1, D),
                            "page_first_direct": (S_host // P, L, P, 1, D)}[layout],
                           dtype=torch.bfloat16)
    else:
        dev = torch.zeros((2, L, S_dev, H, D), dtype=torch.bfloat16, device=where)
        host = torch.zeros({"layer_first": (2, L, S_host, H, D),
                            "page_first": (2, S_host, L, H, D),
                            "page_first_direct": (2, S_host // P, L, P, H, D)}[layout],
                           dtype=torch.bfloat16)
    dev.view(torch.int16).random_(-30000, 30000)
    original = dev.clone()
    with hicache.HiCache(cfg, device_kv=dev, host_kv=host) as c:
        slots = c.alloc_device(2 * P)
        host_slots = c.write(slots, 1)
        assert c.wait_acks("write", 1) == [(1, True)]

        def host_unit(kv, layer, t):  # SGLang's indexing of its host kv_buffer
            b = host if mla else host[kv]
            if layout == "layer_first":
                return b[layer, t]
            if layout == "page_first":
                return b[t, layer]
            return b[t // P, layer, t % P]

        def dev_unit(tensor, kv, layer, t):
            return tensor[layer, t] if mla else tensor[kv, layer, t]

        for s, h in zip(slots, host_slots):
            for kv in range(1 if mla else 2):
                for layer in range(L):
                    assert torch.equal(host_unit(kv, layer, h).view(torch.int16),
                                       dev_unit(original, kv, layer, s).cpu().view(torch.int16))
        c.evict_device(slots, host_slots)
        into = c.alloc_device(2 * P)
        dev.zero_()
        _load_back(c, host_slots, into, L)
        for s, d in zip(slots, into):
            for kv in range(1 if mla else 2):
                for layer in range(L):
                    assert torch.equal(dev_unit(dev, kv, layer, d).view(torch.int16),
                                       dev_unit(original, kv, layer, s).view(torch.int16))


def test_engine_tensors_that_do_not_fit_are_refused():
    cfg = {"device": "host", "page_size": 4, "device_tokens": 64, "model": MODEL}
    with pytest.raises(ValueError, match="is not 64 slots"):
        hicache.HiCache(cfg, device_kv=torch.zeros(10))
    # SGLang's device buffers have a padding page: device_tokens must count it.
    with pytest.raises(ValueError, match="device_tokens must be the buffer's slot count"):
        hicache.HiCache(cfg, device_kv=torch.zeros((2, 2, 64 + 4, 1, 8), dtype=torch.float16))
    with pytest.raises(ValueError, match="not contiguous"):
        hicache.HiCache(cfg, device_kv=torch.zeros(2, 2, 64, 1, 8).transpose(0, 2))
    with pytest.raises(ValueError, match="unknown dimension order"):
        hicache.HiCache(cfg, dim_order="sideways")
    # Per-layer buffers that overlap are refused.
    base = torch.zeros(10000, dtype=torch.float16)
    k = [base[0:512].view(64, 1, 8), base[1000:1512].view(64, 1, 8)]
    with pytest.raises(ValueError, match="overlap"):
        hicache.HiCache(cfg, device_k=k, device_v=[base[256:768].view(64, 1, 8),
                                                   base[3000:3512].view(64, 1, 8)])


def test_per_layer_tensors_allocated_one_by_one_are_the_pools_memory():
    """SGLang's device pool: one torch tensor per layer for K and one for V, allocated one by
    one (no stride relates them). A page written to the host and loaded back into other slots
    lands in each layer's own tensor, and nothing else of them changes."""
    L, P, S_dev, S_host, H, D = 3, 4, 64, 128, 2, 8
    cfg = {"device": "host", "page_size": P, "device_tokens": S_dev, "host_tokens": S_host,
           "io_backend": "kernel", "metrics": False,
           "model": {"layers": L, "kv_heads": H, "head_dim": D, "dtype": "bf16"}}
    spacers = []
    k, v = [], []
    for layer in range(L):  # allocations of other sizes in between: unrelated addresses
        k.append(torch.zeros((S_dev, H, D), dtype=torch.bfloat16))
        spacers.append(torch.zeros(1000 + 77 * layer, dtype=torch.int8))
        v.append(torch.zeros((S_dev, H, D), dtype=torch.bfloat16))
    for t in k + v:
        t.view(torch.int16).random_(-30000, 30000)
    original = [t.clone() for t in k + v]
    with hicache.HiCache(cfg, device_k=k, device_v=v) as c:
        slots = c.alloc_device(2 * P)
        host_slots = c.write(slots, 1)
        assert c.wait_acks("write", 1) == [(1, True)]
        c.evict_device(slots, host_slots)
        into = c.alloc_device(2 * P)
        for t in k + v:
            t.zero_()
        _load_back(c, host_slots, into, L)
    for now, was in zip(k + v, original):
        expected = torch.zeros_like(was)
        expected[into] = was[slots]
        assert torch.equal(now.view(torch.int16), expected.view(torch.int16))
