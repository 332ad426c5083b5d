#include "storage/page_key.h"

#include <openssl/evp.h>

#include <bit>
#include <cstring>

#include "transfer/errors.h"

namespace hicache {
namespace {

bool safe_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '+' || c == '=' || c == '@' || c == ',' || c == '-';
}

void append_encoded(std::string& out, std::string_view field, const char* name) {
  if (field.empty()) throw InvalidArgument(str_cat("key namespace: ", name, " is empty"));
  static constexpr char kHex[] = "0123456789ABCDEF";
  for (char c : field) {
    if (safe_char(c)) {
      out += c;
    } else {
      const auto u = static_cast<unsigned char>(c);
      out += '%';
      out += kHex[u >> 4];
      out += kHex[u & 15];
    }
  }
}

}  // namespace

std::string KeyNamespace::prefix() const {
  if (page_size < 1) throw InvalidArgument(str_cat("key namespace: page_size ", page_size, " < 1"));
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size) {
    throw InvalidArgument(str_cat("key namespace: tp_rank ", tp_rank, " outside [0, tp_size ",
                                  tp_size, ")"));
  }
  std::string out;
  append_encoded(out, model, "model");
  out += '.';
  append_encoded(out, fingerprint, "fingerprint");
  out += '.';
  append_encoded(out, dtype, "dtype");
  out += '.';
  append_encoded(out, layout, "layout");
  out += str_cat(".p", page_size);
  out += mla ? std::string(".mla") : str_cat(".tp", tp_rank, "of", tp_size);
  return out;
}

PageHasher::PageHasher() {
  md_ = EVP_MD_fetch(nullptr, "SHA256", nullptr);
  ctx_ = EVP_MD_CTX_new();
  if (md_ == nullptr || ctx_ == nullptr) {
    EVP_MD_free(static_cast<EVP_MD*>(md_));
    EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_));
    throw Error("OpenSSL: SHA-256 is not available");
  }
}

PageHasher::~PageHasher() {
  EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_));
  EVP_MD_free(static_cast<EVP_MD*>(md_));
}

PageDigest PageHasher::hash(const PageDigest* prev, std::span<const std::int32_t> tokens) {
  static_assert(std::endian::native == std::endian::little,
                "token ids are hashed as little-endian u32; add a byte swap for this target");
  return digest(prev == nullptr ? nullptr : prev->data(), prev == nullptr ? 0 : prev->size(),
                tokens.data(), tokens.size_bytes());
}

PageDigest PageHasher::hash_bytes(std::string_view bytes) {
  return digest(bytes.data(), bytes.size(), nullptr, 0);
}

PageDigest PageHasher::digest(const void* a, std::size_t a_bytes, const void* b,
                              std::size_t b_bytes) {
  auto* ctx = static_cast<EVP_MD_CTX*>(ctx_);
  PageDigest out{};
  unsigned int len = 0;
  bool ok = EVP_DigestInit_ex2(ctx, static_cast<EVP_MD*>(md_), nullptr) == 1;
  if (ok && a_bytes != 0) ok = EVP_DigestUpdate(ctx, a, a_bytes) == 1;
  if (ok && b_bytes != 0) ok = EVP_DigestUpdate(ctx, b, b_bytes) == 1;
  if (ok) ok = EVP_DigestFinal_ex(ctx, out.data(), &len) == 1 && len == out.size();
  if (!ok) throw Error("OpenSSL: SHA-256 digest failed");
  return out;
}

std::string to_hex(const PageDigest& digest) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(digest.size() * 2, '0');
  for (std::size_t i = 0; i < digest.size(); ++i) {
    out[2 * i] = kHex[digest[i] >> 4];
    out[2 * i + 1] = kHex[digest[i] & 15];
  }
  return out;
}

PageDigest digest_from_hex(std::string_view hex) {
  auto nibble = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  PageDigest out{};
  bool ok = hex.size() == out.size() * 2;
  for (std::size_t i = 0; ok && i < out.size(); ++i) {
    const int hi = nibble(hex[2 * i]);
    const int lo = nibble(hex[2 * i + 1]);
    ok = hi >= 0 && lo >= 0;
    out[i] = static_cast<std::uint8_t>((hi << 4) | lo);
  }
  if (!ok) throw InvalidArgument(str_cat("'", hex, "' is not a 64-digit hex page digest"));
  return out;
}

PageKeyer::PageKeyer(const KeyNamespace& ns) : prefix_(ns.prefix()), page_size_(ns.page_size) {
  // Checked here, at set-up: a namespace too long for its keys would otherwise make every
  // storage call of the controller's threads fail.
  const std::size_t key_bytes = prefix_.size() + 1 + 2 * std::tuple_size_v<PageDigest>;
  if (key_bytes > kMaxKeyBytes) {
    throw InvalidArgument(str_cat("key namespace: prefix '", prefix_, "' of ", prefix_.size(),
                                  " bytes makes keys of ", key_bytes, " bytes, at most ",
                                  kMaxKeyBytes, ": shorten the model or fingerprint"));
  }
}

std::string PageKeyer::key(const PageDigest& digest) const {
  std::string out;
  out.reserve(prefix_.size() + 1 + digest.size() * 2);
  out += prefix_;
  out += '-';
  out += to_hex(digest);
  return out;
}

void PageKeyer::keys(std::span<const std::int32_t> tokens, const PageDigest* prior,
                     std::vector<std::string>& out, std::vector<PageDigest>* digests) {
  const auto page = static_cast<std::size_t>(page_size_);
  const std::size_t pages = tokens.size() / page;
  out.reserve(out.size() + pages);
  if (digests != nullptr) digests->reserve(digests->size() + pages);
  PageDigest last{};
  const PageDigest* prev = prior;
  for (std::size_t i = 0; i < pages; ++i) {
    last = hasher_.hash(prev, tokens.subspan(i * page, page));
    prev = &last;
    out.push_back(key(last));
    if (digests != nullptr) digests->push_back(last);
  }
}

PageDigest PageKeyer::identity_seed(std::string_view identity) {
  std::string text = "hicache-identity\n";
  text += identity;
  return hasher_.hash_bytes(text);
}

void validate_key(std::string_view key) {
  bool ok = !key.empty() && key.size() <= kMaxKeyBytes && key.front() != '.';
  for (std::size_t i = 0; ok && i < key.size(); ++i) {
    ok = safe_char(key[i]) || key[i] == '.' || key[i] == '%';
  }
  if (!ok) {
    throw InvalidArgument(str_cat("bad storage key '", key, "': want 1..", kMaxKeyBytes,
                                  " characters of [A-Za-z0-9_+=@,%.-], not starting with '.'"));
  }
}

}  // namespace hicache
