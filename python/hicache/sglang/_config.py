"""The drop-in controller's configuration: how each key of the extra config's "hicache" object
is classified (effective, taken from SGLang, or a decision of SGLang's radix cache) and checked,
the write policies SGLang may name, and SGLang's KV dtypes and TP group as hicache names them."""

_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
_OWN_EXTRA_KEY = "hicache"  # extra-config object merged into the HiCache config (tp_store_dir, ...)
_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float8_e4m3fn": "fp8",
           "float8_e5m2": "fp8", "uint8": "fp8"}

# Keys of the extra config's "hicache" object, by what becomes of them in the drop-in. Every key
# of the HiCache config schema (docs/configuration.md) and its SGLang aliases is in exactly one
# table (a test checks it against config_reference()).
# Effective: hicache's own machinery behind the drop-in reads them.
_OWN_EFFECTIVE = {
    "model_fingerprint": "the L3 key namespace (a new revision never reads old pages)",
    "metrics": "whether the components register metrics",
    "metrics_port": "the /metrics HTTP server",
    "metrics_bind": "the /metrics HTTP server's address",
    "tp_store_dir": "where the TP ranks' Gloo groups meet (TP above 1)",
    "tp_hostname": "the address this rank's Gloo group listens on",
    "tp_timeout_ms": "how long an agreement between the TP ranks may take",
    "tp_connect_timeout_ms": "how long the TP ranks' rendezvous may take",
    "queue_capacity": "the C++ queues' capacity",
    "layer_slots": "load batches in flight (the layer counter's slots)",
    "kernel_max_blocks": "CUDA blocks of the kernel io path",
    "storage_batch_pages": "pages per storage call",
}
# Refused: the drop-in takes them from SGLang (a second value could only disagree).
_OWN_FROM_SGLANG = {
    "device": "the device of SGLang's KV tensors",
    "page_size": "--page-size",
    "device_tokens": "SGLang's device pool (the rows of its k_buffer / kv_buffer)",
    "model": "SGLang's device pool (its tensors' shapes and dtype)",
    "host_ratio": "--hicache-ratio / --hicache-size (SGLang's host pool)",
    "host_bytes": "--hicache-ratio / --hicache-size (SGLang's host pool)",
    "host_tokens": "--hicache-ratio / --hicache-size (SGLang's host pool)",
    "hicache_ratio": "--hicache-ratio (SGLang's host pool)",
    "hicache_size": "--hicache-size (SGLang's host pool)",
    "host_layout": "--hicache-mem-layout",
    "hicache_mem_layout": "--hicache-mem-layout",
    "io_backend": "--hicache-io-backend",
    "hicache_io_backend": "--hicache-io-backend",
    "write_policy": "--hicache-write-policy",
    "hicache_write_policy": "--hicache-write-policy",
    "host_tier": "--enable-hierarchical-cache (the drop-in always has SGLang's host pool)",
    "storage": "--hicache-storage-backend and --hicache-storage-backend-extra-config",
    "hicache_storage_backend": "--hicache-storage-backend",
    "hicache_storage_backend_extra_config": "--hicache-storage-backend-extra-config",
    "model_name": "--served-model-name",
    "prefetch_threshold_tokens": "the extra config's prefetch_threshold",
    "tp_rank": "SGLang's tp_group",
    "tp_size": "SGLang's tp_group",
    "sidecars": "SGLang's hybrid pool group (the drop-in moves KV pages; a hybrid model's "
                "pools reach L3 through HiCacheStore's storage v2)",
}
# Refused: decisions of the radix cache, which is SGLang's when the drop-in runs.
_OWN_RADIX = {
    "prefetch_policy": "--hicache-storage-prefetch-policy",
    "hicache_storage_prefetch_policy": "--hicache-storage-prefetch-policy",
    "prefetch_timeout_base_ms": "the extra config's prefetch_timeout_base (seconds)",
    "prefetch_timeout_per_page_ms": "the extra config's prefetch_timeout_per_ki_token (seconds)",
    "prefetch_timeout_cap_ms": "the extra config's prefetch_timeout_base and "
                               "prefetch_timeout_per_ki_token (SGLang's radix cache times its "
                               "prefetches)",
    "prefetch_budget_tokens": "SGLang's radix cache, which reserves the prefetch pages itself "
                              "(prefetch_rate_limited() caps them at 0.8 x (host - device))",
    "eviction_policy": "--radix-eviction-policy",
    "write_through_threshold": "SGLang's radix cache (1 under write_through, 2 under "
                               "write_through_selective)",
    "load_back_min_tokens": "SGLang's radix cache (its load_back_threshold)",
    "recompute_seconds_per_token": "nowhere: SGLang's radix cache always loads a host hit",
    "demote_low_watermark": "nowhere: SGLang's radix cache evicts when it needs room",
    "demote_high_watermark": "nowhere: SGLang's radix cache evicts when it needs room",
    "storage_admission": "nowhere: SGLang's radix cache backs up every page that reaches the "
                         "host (write_through)",
    "storage_admission_min_hits": "nowhere: SGLang's radix cache backs up every page that "
                                  "reaches the host (write_through)",
    "kv_events": "--kv-events-config (SGLang's radix cache publishes the KV events of the tree "
                 "it owns)",
}
# Keys of SGLang's own radix cache in the extra config (SGLang reads them; later releases take
# them out before the controller sees the extra config, earlier ones pass them through).
_SGLANG_RADIX_EXTRA_KEYS = ("prefetch_threshold", "prefetch_timeout_base",
                            "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys")


def _own_config(own):
    """The "hicache" object's keys, checked: a key the drop-in cannot honour is refused with
    the reason and where SGLang sets it instead."""
    if not isinstance(own, dict):
        raise ValueError(f"hicache: extra config '{_OWN_EXTRA_KEY}' must be an object of "
                         f"HiCache config keys, not {own!r}")
    for key in own:
        if key in _OWN_FROM_SGLANG:
            raise ValueError(
                f"hicache: extra config key '{_OWN_EXTRA_KEY}.{key}' is not accepted by the "
                f"drop-in controller: it takes the value from SGLang ({_OWN_FROM_SGLANG[key]})")
        if key in _OWN_RADIX:
            raise ValueError(
                f"hicache: extra config key '{_OWN_EXTRA_KEY}.{key}' has no effect in the drop-in "
                "controller: it is a decision of the radix cache, which is SGLang's here; set it "
                f"in SGLang: {_OWN_RADIX[key]}")
    return own  # other keys: effective ones, or unknown ones the config parser names


def _dtype_name(dtype):
    text = str(dtype)
    text = text[len("torch."):] if text.startswith("torch.") else text
    if text not in _DTYPES:
        raise ValueError(f"hicache: KV dtype {dtype} is not supported (valid: "
                         f"{', '.join(sorted(_DTYPES))})")
    return _DTYPES[text]


def _tp_of(tp_group):
    if tp_group is None:
        return 0, 1
    import torch.distributed as dist
    return dist.get_rank(group=tp_group), dist.get_world_size(group=tp_group)
