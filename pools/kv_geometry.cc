#include "pools/kv_geometry.h"

#include "transfer/errors.h"

namespace hicache {

DType parse_dtype(std::string_view name) {
  if (name == "fp16" || name == "float16" || name == "half") return DType::kFloat16;
  if (name == "bf16" || name == "bfloat16") return DType::kBFloat16;
  if (name == "fp8" || name == "fp8_e4m3") return DType::kFloat8E4M3;
  if (name == "fp32" || name == "float32" || name == "float") return DType::kFloat32;
  throw InvalidArgument(
      str_cat("unknown dtype '", name, "': valid are fp16, bf16, fp8 (fp8_e4m3), fp32"));
}

std::string_view to_string(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return "fp16";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat8E4M3:
      return "fp8_e4m3";
    case DType::kFloat32:
      return "fp32";
  }
  return "unknown";
}

std::int32_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat8E4M3:
      return 1;
    case DType::kFloat32:
      return 4;
  }
  throw InvalidArgument(str_cat("dtype_size: unknown dtype value ", static_cast<int>(dtype)));
}

KVGeometry KVGeometry::mha(std::int32_t num_layers, std::int32_t num_kv_heads,
                           std::int32_t head_dim, DType dtype, std::int32_t page_size) {
  KVGeometry g{.attention = AttentionKind::kMHA,
               .num_layers = num_layers,
               .num_kv_heads = num_kv_heads,
               .head_dim = head_dim,
               .dtype = dtype,
               .page_size = page_size};
  g.validate();
  return g;
}

KVGeometry KVGeometry::mla(std::int32_t num_layers, std::int32_t kv_lora_rank,
                           std::int32_t qk_rope_head_dim, DType dtype, std::int32_t page_size) {
  KVGeometry g{.attention = AttentionKind::kMLA,
               .num_layers = num_layers,
               .kv_lora_rank = kv_lora_rank,
               .qk_rope_head_dim = qk_rope_head_dim,
               .dtype = dtype,
               .page_size = page_size};
  g.validate();
  return g;
}

void KVGeometry::validate() const {
  auto positive = [](std::int64_t v, const char* field) {
    if (v <= 0) throw InvalidArgument(str_cat("KVGeometry: ", field, " must be > 0, got ", v));
  };
  positive(num_layers, "num_layers");
  positive(page_size, "page_size");
  dtype_size(dtype);  // rejects a dtype value outside the enum
  if (attention == AttentionKind::kMHA) {
    positive(num_kv_heads, "num_kv_heads");
    positive(head_dim, "head_dim");
  } else if (attention == AttentionKind::kMLA) {
    positive(kv_lora_rank, "kv_lora_rank");
    if (qk_rope_head_dim < 0) {
      throw InvalidArgument(
          str_cat("KVGeometry: qk_rope_head_dim must be >= 0, got ", qk_rope_head_dim));
    }
  } else {
    throw InvalidArgument(
        str_cat("KVGeometry: unknown attention kind ", static_cast<int>(attention)));
  }
  // Keep every offset of a realistic pool inside int64 and one unit inside int32 elements.
  if (unit_bytes() > (std::int64_t{1} << 30)) {
    throw InvalidArgument(str_cat("KVGeometry: one token of one layer is ", unit_bytes(),
                                  " bytes, more than 1 GiB"));
  }
}

std::int64_t KVGeometry::unit_bytes() const {
  const std::int64_t elements = attention == AttentionKind::kMHA
                                    ? std::int64_t{num_kv_heads} * head_dim
                                    : std::int64_t{kv_lora_rank} + qk_rope_head_dim;
  return elements * dtype_size(dtype);
}

std::string KVGeometry::describe() const {
  if (attention == AttentionKind::kMHA) {
    return str_cat("MHA ", num_layers, " layers x ", num_kv_heads, " kv heads x ", head_dim,
                   " dims, ", to_string(dtype), ", page ", page_size, " tokens (",
                   page_bytes() / 1024, " KiB/page)");
  }
  return str_cat("MLA ", num_layers, " layers x (", kv_lora_rank, " + ", qk_rope_head_dim,
                 ") dims, ", to_string(dtype), ", page ", page_size, " tokens (",
                 page_bytes() / 1024, " KiB/page)");
}

}  // namespace hicache
