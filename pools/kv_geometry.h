// KVGeometry: the shape of a model's KV cache (layers, heads, head dim, dtype, page size) for
// multi-head attention (a K and a V buffer per layer) and multi-head latent attention (one
// latent buffer per layer of kv_lora_rank + qk_rope_head_dim elements per token).
//
// Vocabulary used across hicache:
//   unit   the bytes of one token of one layer of one of K/V (or of the latent);
//   page   page_size consecutive token slots; everything moves in whole pages.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace hicache {

enum class DType { kFloat16, kBFloat16, kFloat8E4M3, kFloat32 };

// Accepts "fp16"/"float16"/"half", "bf16"/"bfloat16", "fp8"/"fp8_e4m3", "fp32"/"float32".
// Throws InvalidArgument naming the value and listing the valid names.
DType parse_dtype(std::string_view name);
std::string_view to_string(DType dtype);
std::int32_t dtype_size(DType dtype);

enum class AttentionKind { kMHA, kMLA };

struct KVGeometry {
  AttentionKind attention = AttentionKind::kMHA;
  std::int32_t num_layers = 0;
  std::int32_t num_kv_heads = 0;      // MHA only
  std::int32_t head_dim = 0;          // MHA only
  std::int32_t kv_lora_rank = 0;      // MLA only
  std::int32_t qk_rope_head_dim = 0;  // MLA only
  DType dtype = DType::kFloat16;
  std::int32_t page_size = 64;

  // Validated constructors: throw InvalidArgument naming the first bad field.
  static KVGeometry mha(std::int32_t num_layers, std::int32_t num_kv_heads, std::int32_t head_dim,
                        DType dtype, std::int32_t page_size);
  static KVGeometry mla(std::int32_t num_layers, std::int32_t kv_lora_rank,
                        std::int32_t qk_rope_head_dim, DType dtype, std::int32_t page_size);

  // Throws InvalidArgument naming the first field out of its domain.
  void validate() const;

  std::int32_t num_kv() const { return attention == AttentionKind::kMHA ? 2 : 1; }
  // Bytes of one unit: one token, one layer, one of K/V (or the latent).
  std::int64_t unit_bytes() const;
  // Bytes of one token over all layers and K/V.
  std::int64_t token_bytes() const { return unit_bytes() * num_layers * num_kv(); }
  // Bytes of one page over all layers and K/V.
  std::int64_t page_bytes() const { return token_bytes() * page_size; }

  std::string describe() const;
  bool operator==(const KVGeometry&) const = default;
};

}  // namespace hicache
