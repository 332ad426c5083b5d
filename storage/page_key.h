// Page keys: how a page is named in L3.
//
// key(page i) = namespace prefix + "-" + hex(H(raw key(page i-1), token ids of page i)), where H is
// SHA-256 over the previous page's 32-byte digest (absent for the first page) followed by the
// page's token ids as little-endian u32. This is the hash SGLang's HiCache computes
// (get_hash_str), so the hex part interoperates with its stores. The prefix names everything
// that makes two pages with the same tokens hold different bytes: model, weights fingerprint,
// KV dtype, host layout, page size and the tensor-parallel slice (or "mla" where every rank
// holds the same KV), so an upgraded model or a changed layout never reads a stale page.
//
// One key function, used everywhere: PageKeyer.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace hicache {

struct KeyNamespace {
  std::string model;        // e.g. "meta-llama/Llama-3.1-8B"
  std::string fingerprint;  // weights revision, e.g. a commit hash
  std::string dtype;        // KV dtype, e.g. "bf16"
  std::string layout;       // host layout, e.g. "page_first"
  std::int64_t page_size = 0;
  int tp_rank = 0;
  int tp_size = 1;
  bool mla = false;  // KV identical on every rank: one namespace for all ranks

  // "<model>.<fingerprint>.<dtype>.<layout>.p<page>.tp<rank>of<size>" (or ".mla"), with every
  // character outside [A-Za-z0-9_+=@,-] percent-encoded, so the prefix is a safe file name and
  // distinct namespaces give distinct prefixes. Throws InvalidArgument naming an empty field,
  // a page size < 1 or a rank outside [0, tp_size).
  std::string prefix() const;
};

using PageDigest = std::array<std::uint8_t, 32>;

// Chained SHA-256 (OpenSSL's libcrypto, one reusable context: not thread-safe; use one per
// thread).
class PageHasher {
 public:
  PageHasher();
  ~PageHasher();
  PageHasher(const PageHasher&) = delete;
  PageHasher& operator=(const PageHasher&) = delete;

  // H(prev, tokens); prev == nullptr for the first page.
  PageDigest hash(const PageDigest* prev, std::span<const std::int32_t> tokens);
  // H(bytes).
  PageDigest hash_bytes(std::string_view bytes);

 private:
  // H(a, b), either part empty.
  PageDigest digest(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes);
  void* ctx_;  // EVP_MD_CTX
  void* md_;   // EVP_MD (fetched once)
};

std::string to_hex(const PageDigest& digest);
// Parses 64 hex digits; throws InvalidArgument naming the text otherwise.
PageDigest digest_from_hex(std::string_view hex);

class PageKeyer {
 public:
  explicit PageKeyer(const KeyNamespace& ns);

  const std::string& prefix() const { return prefix_; }
  std::int64_t page_size() const { return page_size_; }

  // Appends the key of every whole page of `tokens` to `out` (a trailing partial page has no
  // key), chained after `prior`: the digest of the page before tokens[0], or nullptr at the
  // start of a sequence. Each page's digest also goes to `digests` when non-null (the last one
  // chains the next call).
  void keys(std::span<const std::int32_t> tokens, const PageDigest* prior,
            std::vector<std::string>& out, std::vector<PageDigest>* digests = nullptr);

  // The full key of one page digest.
  std::string key(const PageDigest& digest) const;
  // A cache identity (a LoRA adapter, a cache salt, a tenant: SGLang's extra_key, vLLM's
  // cache_salt) as the `prior` of its sequences' first page: H("hicache-identity\n" + identity).
  // Two identities' pages never share a key; the empty identity chains from nothing (the keys
  // of a cache without identities, SGLang's keys).
  PageDigest identity_seed(std::string_view identity);

 private:
  std::string prefix_;
  std::int64_t page_size_;
  PageHasher hasher_;
};

// Throws InvalidArgument naming the key unless it is 1..kMaxKeyBytes characters of
// [A-Za-z0-9_+=@,%.-] not starting with '.': a safe file name and a plain Redis key.
inline constexpr std::size_t kMaxKeyBytes = 240;
void validate_key(std::string_view key);

}  // namespace hicache
