#include "storage/page_key.h"

#include <gtest/gtest.h>

#include <optional>

#include <numeric>

#include "transfer/errors.h"

namespace hicache {
namespace {

KeyNamespace test_ns(int page_size = 4) {
  return KeyNamespace{.model = "meta-llama/Llama-3.1-8B", .fingerprint = "rev1", .dtype = "bf16",
                      .layout = "page_first", .page_size = page_size, .tp_rank = 1, .tp_size = 2};
}

// Vectors from Python: SGLang's get_hash_str (hashlib.sha256 over the prior digest's bytes, then
// each token as 4 little-endian bytes).
constexpr const char* kPage0 = "baed642339816affb3fe8719792d0e4ce82f12db72b7373d244eaa65445800fe";
constexpr const char* kPage1 = "01414b052706d93bd0f1f1646c0e8ca2fa8ef5efd7bcc99f7a1cee8eb11ad052";

TEST(PageKey, ChainedSha256MatchesSglangHashes) {
  PageKeyer keyer(test_ns());
  std::vector<std::int32_t> tokens(10);
  std::iota(tokens.begin(), tokens.end(), 0);
  std::vector<std::string> keys;
  std::vector<PageDigest> digests;
  keyer.keys(tokens, nullptr, keys, &digests);
  ASSERT_EQ(keys.size(), 2u) << "the trailing partial page has no key";
  EXPECT_EQ(to_hex(digests[0]), kPage0);
  EXPECT_EQ(to_hex(digests[1]), kPage1);
  EXPECT_EQ(keys[0], keyer.prefix() + "-" + kPage0);
  EXPECT_EQ(keys[1], keyer.prefix() + "-" + kPage1);
  for (const auto& k : keys) EXPECT_NO_THROW(validate_key(k)) << k;
}

TEST(PageKey, ChainingAcrossCallsEqualsOneCall) {
  PageKeyer keyer(test_ns());
  std::vector<std::int32_t> tokens(8);
  std::iota(tokens.begin(), tokens.end(), 0);
  std::vector<std::string> first, second;
  std::vector<PageDigest> digests;
  keyer.keys(std::span(tokens).first(4), nullptr, first, &digests);
  const PageDigest prior = digest_from_hex(kPage0);
  keyer.keys(std::span(tokens).subspan(4), &prior, second);
  ASSERT_EQ(second.size(), 1u);
  EXPECT_EQ(second[0], keyer.prefix() + "-" + kPage1);
  EXPECT_EQ(digests[0], prior);
}

// A cache identity seeds the chain: every page key differs from the keys without one and from
// another identity's, the same identity always gives the same keys, and the chain continues
// across calls from the identity's last digest as from any other.
TEST(PageKey, AnIdentityChangesEveryKeyOfItsSequence) {
  PageKeyer keyer(test_ns());
  std::vector<std::int32_t> tokens(4 * 4);  // four pages
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>(i * 7);
  auto keys_of = [&](std::optional<std::string_view> identity) {
    std::vector<std::string> out;
    std::optional<PageDigest> seed;
    if (identity) seed = keyer.identity_seed(*identity);
    keyer.keys(tokens, seed ? &*seed : nullptr, out);
    return out;
  };
  const auto plain = keys_of(std::nullopt), a = keys_of("tenant-a"), b = keys_of("tenant-b");
  ASSERT_EQ(plain.size(), 4u);
  for (std::size_t i = 0; i < plain.size(); ++i) {
    EXPECT_NE(a[i], plain[i]) << i;
    EXPECT_NE(a[i], b[i]) << i;
  }
  EXPECT_EQ(keys_of("tenant-a"), a);
  EXPECT_NE(keyer.identity_seed("a"), keyer.identity_seed("b"));
}

TEST(PageKey, EveryNamespaceFieldChangesThePrefix) {
  const std::string base = test_ns().prefix();
  EXPECT_EQ(base, "meta-llama%2FLlama-3%2E1-8B.rev1.bf16.page_first.p4.tp1of2");
  auto differs = [&](auto edit) {
    KeyNamespace ns = test_ns();
    edit(ns);
    return ns.prefix() != base;
  };
  EXPECT_TRUE(differs([](KeyNamespace& ns) { ns.model = "other"; }));
  EXPECT_TRUE(differs([](KeyNamespace& ns) { ns.fingerprint = "rev2"; }));
  EXPECT_TRUE(differs([](KeyNamespace& ns) { ns.dtype = "fp8"; }));
  EXPECT_TRUE(differs([](KeyNamespace& ns) { ns.layout = "layer_first"; }));
  EXPECT_TRUE(differs([](KeyNamespace& ns) { ns.page_size = 64; }));
  EXPECT_TRUE(differs([](KeyNamespace& ns) { ns.tp_rank = 0; }));
  EXPECT_TRUE(differs([](KeyNamespace& ns) { ns.tp_size = 4; }));
  // MLA: one namespace for every rank.
  KeyNamespace a = test_ns(), b = test_ns();
  a.mla = b.mla = true;
  b.tp_rank = 0;
  EXPECT_EQ(a.prefix(), b.prefix());
  // Percent-encoding keeps distinct names distinct.
  KeyNamespace slash = test_ns(), under = test_ns();
  slash.model = "a/b";
  under.model = "a_b";
  EXPECT_NE(slash.prefix(), under.prefix());
}

TEST(PageKey, BadNamespaceNamesTheField) {
  auto message = [](KeyNamespace ns) {
    try {
      (void)ns.prefix();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  KeyNamespace ns = test_ns();
  ns.model = "";
  EXPECT_NE(message(ns).find("model is empty"), std::string::npos);
  ns = test_ns();
  ns.page_size = 0;
  EXPECT_NE(message(ns).find("page_size 0"), std::string::npos);
  ns = test_ns();
  ns.tp_rank = 2;
  EXPECT_NE(message(ns).find("tp_rank 2"), std::string::npos);
  EXPECT_THROW(PageKeyer{ns}, InvalidArgument);
  // A prefix that leaves no room for the digest within kMaxKeyBytes is refused at set-up, not
  // at every later storage call; the longest that fits is accepted, and its keys are valid.
  ns = test_ns();
  ns.model = "m";  // one byte, encoded as itself
  const std::size_t fixed = ns.prefix().size() - 1;
  ns.model = std::string(kMaxKeyBytes - 65 - fixed + 1, 'm');
  try {
    PageKeyer too_long(ns);
    ADD_FAILURE() << "a prefix of " << ns.prefix().size() << " bytes was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("at most 240"), std::string::npos) << e.what();
  }
  ns.model.pop_back();
  PageKeyer longest(ns);
  std::vector<std::string> keys;
  longest.keys(std::vector<std::int32_t>(static_cast<std::size_t>(ns.page_size), 7), nullptr, keys);
  ASSERT_EQ(keys.size(), 1u);
  EXPECT_EQ(keys[0].size(), kMaxKeyBytes);
  EXPECT_NO_THROW(validate_key(keys[0]));
}

TEST(PageKey, ValidateKeyRejectsPathsAndEmpty) {
  EXPECT_NO_THROW(validate_key("abc-0123.p64"));
  for (const std::string& bad : std::vector<std::string>{"", "../etc/passwd", "a/b", ".hidden", "sp ace", "nl\n", "q\"",
                          std::string(kMaxKeyBytes + 1, 'a'), std::string("nul\0x", 5)}) {
    EXPECT_THROW(validate_key(bad), InvalidArgument) << bad;
  }
  try {
    validate_key("a/b");
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'a/b'"), std::string::npos) << e.what();
  }
}

TEST(PageKey, DigestHexRoundTripAndRejectsBadHex) {
  const PageDigest d = digest_from_hex(kPage0);
  EXPECT_EQ(to_hex(d), kPage0);
  EXPECT_THROW(digest_from_hex("abc"), InvalidArgument);
  EXPECT_THROW(digest_from_hex(std::string(64, 'g')), InvalidArgument);
}

}  // namespace
}  // namespace hicache
