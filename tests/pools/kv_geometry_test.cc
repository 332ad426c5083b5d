#include "pools/kv_geometry.h"

#include <gtest/gtest.h>

#include "transfer/errors.h"

namespace hicache {
namespace {

TEST(KVGeometry, ParsesEveryDtypeNameAndSize) {
  EXPECT_EQ(parse_dtype("fp16"), DType::kFloat16);
  EXPECT_EQ(parse_dtype("float16"), DType::kFloat16);
  EXPECT_EQ(parse_dtype("bf16"), DType::kBFloat16);
  EXPECT_EQ(parse_dtype("fp8"), DType::kFloat8E4M3);
  EXPECT_EQ(parse_dtype("fp8_e4m3"), DType::kFloat8E4M3);
  EXPECT_EQ(parse_dtype("fp32"), DType::kFloat32);
  EXPECT_EQ(dtype_size(DType::kFloat16), 2);
  EXPECT_EQ(dtype_size(DType::kBFloat16), 2);
  EXPECT_EQ(dtype_size(DType::kFloat8E4M3), 1);
  EXPECT_EQ(dtype_size(DType::kFloat32), 4);
  for (DType d : {DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3, DType::kFloat32}) {
    EXPECT_EQ(parse_dtype(to_string(d)), d);
  }
}

TEST(KVGeometry, UnknownDtypeNamesTheValue) {
  try {
    parse_dtype("int4");
    FAIL() << "no exception";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'int4'"), std::string::npos) << e.what();
  }
}

TEST(KVGeometry, StandardMhaPageIs8MiB) {
  auto g = KVGeometry::mha(32, 8, 128, DType::kFloat16, 64);
  EXPECT_EQ(g.num_kv(), 2);
  EXPECT_EQ(g.unit_bytes(), 8 * 128 * 2);
  EXPECT_EQ(g.page_bytes() / g.num_layers, 256 * 1024);  // 256 KiB per layer per page
  EXPECT_EQ(g.page_bytes(), 8 << 20);
}

TEST(KVGeometry, MlaHasOneLatentBuffer) {
  auto g = KVGeometry::mla(61, 512, 64, DType::kBFloat16, 64);
  EXPECT_EQ(g.num_kv(), 1);
  EXPECT_EQ(g.unit_bytes(), (512 + 64) * 2);
  EXPECT_EQ(g.token_bytes(), 61 * (512 + 64) * 2);
}

TEST(KVGeometry, RejectsZeroAndNegativeFieldsByName) {
  struct Case {
    std::function<void()> make;
    const char* field;
  } cases[] = {
      {[] { KVGeometry::mha(0, 8, 128, DType::kFloat16, 64); }, "num_layers"},
      {[] { KVGeometry::mha(32, -1, 128, DType::kFloat16, 64); }, "num_kv_heads"},
      {[] { KVGeometry::mha(32, 8, 0, DType::kFloat16, 64); }, "head_dim"},
      {[] { KVGeometry::mha(32, 8, 128, DType::kFloat16, 0); }, "page_size"},
      {[] { KVGeometry::mla(32, 0, 64, DType::kFloat16, 64); }, "kv_lora_rank"},
      {[] { KVGeometry::mla(32, 512, -1, DType::kFloat16, 64); }, "qk_rope_head_dim"},
      {[] { KVGeometry::mha(32, 8, 128, static_cast<DType>(9), 64); }, "dtype"},
  };
  for (auto& c : cases) {
    try {
      c.make();
      ADD_FAILURE() << "no exception for " << c.field;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(c.field), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace hicache
