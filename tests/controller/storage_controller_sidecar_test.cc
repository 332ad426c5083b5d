// StorageController with sidecar pools (a hybrid model's state beside the KV, docs/hybrid.md):
// a backup stores each pool's pages under the pool's own namespace after the KV's, and its
// stored prefix stops at the first page whose KV or sidecar record failed; a prefetch's hit is
// the longest prefix every pool restores from what L3 holds (gaps in a trailing pool's
// checkpoints, a missing all_pages record, a foreign pool's records), agreed by the TP ranks as
// an intersection of their restorable lengths; what it hands over is byte for byte what was
// stored, and every slot of the reservations it does not hand over is free again.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>

#include "controller/storage_controller.h"
#include "pools/kv_pattern.h"
#include "storage/file_storage.h"
#include "transfer/errors.h"
#include "transfer/host_device.h"

namespace hicache {
namespace {

namespace fs = std::filesystem;
constexpr std::int32_t kPage = 4;
using Slots = std::vector<std::int64_t>;
enum Pool : std::int32_t { kState = 0, kIndex = 1 };

KeyNamespace ns() {
  return {.model = "m", .fingerprint = "f", .dtype = "fp16", .layout = "page_first",
          .page_size = kPage};
}

SidecarSpec state_spec(std::int64_t slot_bytes = 64) {
  return {.name = "state", .policy = SidecarHitPolicy::kTrailing, .window_pages = 1, .layers = 2,
          .slots_per_page = 1, .slot_bytes = slot_bytes, .dtype = DType::kFloat32,
          .device_pages = 4, .host_pages = 16};
}
SidecarSpec index_spec() {
  return {.name = "index", .policy = SidecarHitPolicy::kAllPages, .slots_per_page = kPage,
          .slot_bytes = 16, .device_pages = 4, .host_pages = 16};
}

// Fails every batch_set and batch_get of a key for which `fail` holds.
class FailingKeys final : public StorageBackend {
 public:
  explicit FailingKeys(StorageBackend& inner) : inner_(inner) {}
  std::string_view name() const override { return "failing-keys"; }
  std::size_t batch_exists(std::span<const std::string> keys) override {
    return inner_.batch_exists(keys);
  }
  std::vector<bool> exists_each(std::span<const std::string> keys) override {
    return inner_.exists_each(keys);
  }
  bool remove(const std::string& key) override { return inner_.remove(key); }
  void clear() override { inner_.clear(); }
  void fail_keys_with(std::string part) {
    std::lock_guard hold(mu_);
    part_ = std::move(part);
  }

 protected:
  std::vector<IoResult> do_batch_get(std::span<const std::string> keys,
                                     std::span<const ByteSpan> dst) override {
    return inject(keys, inner_.batch_get(keys, dst));
  }
  // A failing key is never stored: only the others reach the store.
  std::vector<IoResult> do_batch_set(std::span<const std::string> keys,
                                     std::span<const ConstByteSpan> src) override {
    std::vector<std::string> pass_keys;
    std::vector<ConstByteSpan> pass_src;
    std::vector<IoResult> out = inject(keys, std::vector<IoResult>(keys.size(), IoResult::ok()));
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (out[i].is_ok()) {
        pass_keys.push_back(keys[i]);
        pass_src.push_back(src[i]);
      }
    }
    const std::vector<IoResult> stored = inner_.batch_set(pass_keys, pass_src);
    for (std::size_t i = 0, j = 0; i < keys.size(); ++i) {
      if (out[i].is_ok()) out[i] = stored[j++];
    }
    return out;
  }

 private:
  std::vector<IoResult> inject(std::span<const std::string> keys, std::vector<IoResult> out) {
    std::lock_guard hold(mu_);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (!part_.empty() && keys[i].find(part_) != std::string::npos) {
        out[i] = IoResult::error("injected");
      }
    }
    return out;
  }
  StorageBackend& inner_;
  std::mutex mu_;
  std::string part_;
};

// One rank: a KV host pool, the two sidecar pools, a file store, and the controller.
struct Rank {
  HostDevice device;
  HostKVPool host{device, KVGeometry::mha(2, 1, 8, DType::kFloat16, kPage),
                  HostLayout::kPageFirst, 16 * kPage};
  SidecarPool state;
  SidecarPool index{device, index_spec()};
  fs::path root;
  FileStorage file;
  bool own_root;
  FailingKeys storage{file};
  std::unique_ptr<StorageController> c;

  // `shared_root`: a store another Rank wrote (kept); else a fresh one of its own.
  Rank(const std::string& name, Collective& prefetch, Collective& backup, Collective& main,
       KeyNamespace keys = ns(), SidecarSpec state_pool = state_spec(), fs::path shared_root = {})
      : state(device, state_pool),
        root(shared_root.empty()
                 ? fs::temp_directory_path() / str_cat("hicache-scs-", name, "-", ::getpid())
                 : shared_root),
        file(FileStorageConfig{
            .root = (shared_root.empty() ? (void)fs::remove_all(root) : (void)0, root.string())}),
        own_root(shared_root.empty()),
        c(std::make_unique<StorageController>(
            host, storage, keys, prefetch, backup, main,
            StorageControllerConfig{.io_batch_pages = 2, .policy = PrefetchPolicy::kWaitComplete},
            std::vector<SidecarPool*>{&state, &index})) {}
  ~Rank() {
    c.reset();
    if (own_root) fs::remove_all(root);
  }

  HostKVPool& pool_host(Pool p) { return p == kState ? state.host_pool() : index.host_pool(); }
  std::int32_t spp(Pool p) const { return p == kState ? 1 : kPage; }
  std::int64_t free_all() {
    return host.free_tokens() + state.host_pool().free_tokens() + index.host_pool().free_tokens();
  }
};

std::vector<std::int32_t> tokens_for(int pages, int seed) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(pages * kPage));
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = seed * 100000 + static_cast<std::int32_t>(i);
  return t;
}

std::vector<std::string> keys_of(std::span<const std::int32_t> tokens) {
  PageKeyer keyer(ns());
  std::vector<std::string> keys;
  keyer.keys(tokens, nullptr, keys);
  return keys;
}

// The key of `spec`'s record of the page whose KV key is `kv_key`.
std::string side_key(const SidecarSpec& spec, const std::string& kv_key) {
  return PageKeyer(sidecar_namespace(ns(), spec)).prefix() +
         kv_key.substr(PageKeyer(ns()).prefix().size());
}

std::uint64_t seed(Pool pool, std::int64_t page, int rank = 0) {
  return 7000 + static_cast<std::uint64_t>(pool) * 1000 + static_cast<std::uint64_t>(page) * 10 +
         static_cast<std::uint64_t>(rank);
}
std::uint64_t kv_seed(std::int64_t page) { return 90000 + static_cast<std::uint64_t>(page); }

// Backs up `pages` pages of `tokens`: KV, the state checkpoints of `state_pages`, the index of
// `index_pages`; waits for the ack and frees the host pages. Returns the stored tokens.
std::int64_t back_up(Rank& r, std::span<const std::int32_t> tokens, int pages,
                     const Slots& state_pages, const Slots& index_pages, int rank = 0) {
  Slots kv = r.host.alloc(pages * kPage).value();
  for (int i = 0; i < pages; ++i) fill_page(r.host.layout(), kv[i * kPage] / kPage, kv_seed(i));
  std::vector<SidecarPagesIo> side;
  for (auto [pool, at] : {std::pair{kState, &state_pages}, std::pair{kIndex, &index_pages}}) {
    SidecarPagesIo io{.pool = pool, .pages = *at, .host_slots = {}};
    if (at->empty()) continue;
    io.host_slots = r.pool_host(pool).alloc(static_cast<std::int64_t>(at->size()) * r.spp(pool)).value();
    for (std::size_t k = 0; k < at->size(); ++k) {
      fill_page(r.pool_host(pool).layout(), io.host_slots[k * r.spp(pool)] / r.spp(pool),
                seed(pool, (*at)[k], rank));
    }
    side.push_back(std::move(io));
  }
  auto keys = keys_of(tokens.first(static_cast<std::size_t>(pages * kPage)));
  const auto id = r.c->write_storage(kv, keys, side);
  EXPECT_TRUE(id.has_value());
  std::vector<BackupAck> acks;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (acks.empty() && std::chrono::steady_clock::now() < deadline) {
    if (r.c->drain_backup_acks(acks) == 0) std::this_thread::yield();
  }
  r.host.free(kv);
  for (const auto& io : side) r.pool_host(static_cast<Pool>(io.pool)).free(io.host_slots);
  return acks.empty() ? -1 : acks[0].completed_tokens;
}

// A prefetch of `tokens` into fresh reservations: waits for it, terminates it, checks every
// page handed over holds its bytes and that nothing else of the reservations is held.
PrefetchResult prefetch(Rank& r, std::span<const std::int32_t> tokens, int rank = 0) {
  const std::int64_t free_before = r.free_all();
  const auto pages = static_cast<std::int64_t>(tokens.size()) / kPage;
  Slots kv = r.host.alloc(pages * kPage).value();
  std::vector<SidecarPagesIo> side;
  for (Pool pool : {kState, kIndex}) {
    const std::int64_t want = r.c->sidecar_reserve_pages(pool, pages);
    side.push_back({.pool = pool, .pages = {},
                    .host_slots = r.pool_host(pool).alloc(want * r.spp(pool)).value()});
  }
  auto op = r.c->prefetch_into(str_cat("req-", rank), tokens, std::nullopt, kv, side);
  EXPECT_TRUE(op);
  if (!op) return {};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!r.c->can_terminate(*op) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
  PrefetchResult res = r.c->terminate_prefetch(*op);
  std::int64_t held = res.tokens;
  for (std::int64_t i = 0; i < res.tokens / kPage; ++i) {
    EXPECT_TRUE(verify_page(r.host.layout(), res.host_slots[static_cast<std::size_t>(i * kPage)] / kPage,
                            kv_seed(i)))
        << "KV page " << i;
  }
  for (const SidecarPagesIo& io : res.sidecars) {
    const auto pool = static_cast<Pool>(io.pool);
    EXPECT_EQ(io.host_slots.size(), io.pages.size() * static_cast<std::size_t>(r.spp(pool)));
    held += static_cast<std::int64_t>(io.host_slots.size());
    for (std::size_t k = 0; k < io.pages.size(); ++k) {
      const std::int64_t page = io.host_slots[k * r.spp(pool)] / r.spp(pool);
      EXPECT_TRUE(verify_page(r.pool_host(pool).layout(), page, seed(pool, io.pages[k], rank)))
          << "pool " << pool << " page " << io.pages[k];
      EXPECT_EQ(r.pool_host(pool).page_state(page), PageState::kBackup);
    }
  }
  EXPECT_EQ(r.free_all(), free_before - held) << "a slot of the reservations not handed over";
  r.host.free(res.host_slots);
  for (const SidecarPagesIo& io : res.sidecars) r.pool_host(static_cast<Pool>(io.pool)).free(io.host_slots);
  return res;
}

Slots pages_of(const PrefetchResult& r, Pool pool) {
  for (const SidecarPagesIo& io : r.sidecars) {
    if (io.pool == pool) return io.pages;
  }
  return {};
}

TEST(StorageControllerSidecars, APrefetchRestoresTheLongestPrefixEveryPoolCanByteForByte) {
  LocalCollective local;
  Rank r("restore", local, local, local);
  const auto tokens = tokens_for(8, 1);
  // 6 pages: state checkpoints after pages 2, 4 and 6 (pages 1, 3, 5), the index everywhere.
  EXPECT_EQ(back_up(r, tokens, 6, {1, 3, 5}, {0, 1, 2, 3, 4, 5}), 6 * kPage);
  EXPECT_GT(r.c->sidecar_written_bytes(), 0);

  // Asked for 8 pages: 6 restorable; the state at page 5 and the index's 6 pages come along.
  PrefetchResult res = prefetch(r, tokens);
  EXPECT_EQ(res.tokens, 6 * kPage);
  EXPECT_EQ(pages_of(res, kState), (Slots{5}));
  EXPECT_EQ(pages_of(res, kIndex), (Slots{0, 1, 2, 3, 4, 5}));

  // The checkpoint after page 6 gone: the prefix ends at the one after page 4.
  const auto keys = keys_of(tokens);
  ASSERT_TRUE(r.file.remove(side_key(state_spec(), keys[5])));
  res = prefetch(r, tokens);
  EXPECT_EQ(res.tokens, 4 * kPage);
  EXPECT_EQ(pages_of(res, kState), (Slots{3}));
  EXPECT_EQ(pages_of(res, kIndex), (Slots{0, 1, 2, 3}));

  // An index record gone (all_pages): nothing restores past it, and the checkpoint before it
  // (after page 2) is the longest prefix.
  ASSERT_TRUE(r.file.remove(side_key(index_spec(), keys[2])));
  res = prefetch(r, tokens);
  EXPECT_EQ(res.tokens, 2 * kPage);
  EXPECT_EQ(pages_of(res, kState), (Slots{1}));
  EXPECT_GT(r.c->sidecar_read_bytes(), 0);
}

// A record that fails to read is a shorter prefix, never wrong bytes: the state's read fails,
// so the KV that only it would restore is not even read.
TEST(StorageControllerSidecars, ASidecarReadThatFailsRestoresNothingItWouldHaveRestored) {
  LocalCollective local;
  Rank r("readfail", local, local, local);
  const auto tokens = tokens_for(4, 2);
  EXPECT_EQ(back_up(r, tokens, 4, {3}, {0, 1, 2, 3}), 4 * kPage);
  r.storage.fail_keys_with("sidecar=state");
  const PrefetchResult res = prefetch(r, tokens);
  EXPECT_EQ(res.tokens, 0);
  EXPECT_TRUE(res.sidecars.empty());
  EXPECT_EQ(r.c->read_bytes(), 0) << "no KV page read that nothing could restore";
}

// A state record corrupted behind the store's back (a disk fault): the store's checksum makes
// its read a miss (counted, the record removed). That prefetch, whose hit the record ended,
// restores nothing (it read only the window before its hit's end); the next one ends at the
// checkpoint before it. No wrong byte either time.
TEST(StorageControllerSidecars, ACorruptStateRecordShortensThePrefixNeverWrongBytes) {
  LocalCollective local;
  Rank r("corrupt", local, local, local);
  const auto tokens = tokens_for(4, 7);
  EXPECT_EQ(back_up(r, tokens, 4, {1, 3}, {0, 1, 2, 3}), 4 * kPage);
  {
    std::fstream f(r.root / side_key(state_spec(), keys_of(tokens)[3]),
                   std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.is_open());
    f.seekg(-1, std::ios::end);
    char c = 0;
    f.get(c);
    f.seekp(-1, std::ios::end);
    f.put(static_cast<char>(c ^ 0x5A));
  }
  EXPECT_EQ(prefetch(r, tokens).tokens, 0);  // verifies every byte handed over
  EXPECT_GE(r.file.stats().bad_records, 1u);
  const PrefetchResult res = prefetch(r, tokens);
  EXPECT_EQ(res.tokens, 2 * kPage);
  EXPECT_EQ(pages_of(res, kState), (Slots{1}));
}

// A backup whose sidecar record fails to store acks only the prefix before that page (the KV
// of every page stored), and the stored prefix is what a prefetch then restores.
TEST(StorageControllerSidecars, ASidecarWriteThatFailsCutsTheStoredPrefix) {
  LocalCollective local;
  Rank r("writefail", local, local, local);
  const auto tokens = tokens_for(6, 3);
  const auto keys = keys_of(tokens);
  r.storage.fail_keys_with(side_key(index_spec(), keys[4]));
  EXPECT_EQ(back_up(r, tokens, 6, {1, 3, 5}, {0, 1, 2, 3, 4, 5}), 4 * kPage);
  EXPECT_EQ(r.file.batch_exists(keys), 6u) << "the KV of every page is stored";
  r.storage.fail_keys_with("");
  const PrefetchResult res = prefetch(r, tokens);
  EXPECT_EQ(res.tokens, 4 * kPage);
  EXPECT_EQ(pages_of(res, kState), (Slots{3}));
  EXPECT_EQ(pages_of(res, kIndex), (Slots{0, 1, 2, 3}));
}

// Records of a pool of another geometry are never found: the same store, the KV records there,
// and nothing restorable; another model's namespace differs too.
TEST(StorageControllerSidecars, AnotherPoolsOrModelsRecordsAreAMiss) {
  LocalCollective local;
  const auto tokens = tokens_for(4, 4);
  const fs::path shared = fs::temp_directory_path() / str_cat("hicache-scs-shared-", ::getpid());
  fs::remove_all(shared);
  {
    Rank writer("foreign-w", local, local, local, ns(), state_spec(), shared);
    EXPECT_EQ(back_up(writer, tokens, 4, {1, 3}, {0, 1, 2, 3}), 4 * kPage);
  }
  {
    Rank same("foreign-same", local, local, local, ns(), state_spec(), shared);
    EXPECT_EQ(prefetch(same, tokens).tokens, 4 * kPage) << "a restart on the same store hits";
  }
  {
    Rank reader("foreign-r", local, local, local, ns(), state_spec(128), shared);
    EXPECT_EQ(reader.file.batch_exists(keys_of(tokens)), 4u) << "the KV records are there";
    EXPECT_EQ(prefetch(reader, tokens).tokens, 0);
  }
  fs::remove_all(shared);
  KeyNamespace other = ns();
  other.model = "another";
  EXPECT_NE(PageKeyer(sidecar_namespace(ns(), state_spec())).prefix(),
            PageKeyer(sidecar_namespace(other, state_spec())).prefix());
}

// TP 2: rank 0 holds state checkpoints restoring 2 and 4 pages, rank 1 restoring 2 and 3. The
// ranks agree on 2 (the largest common length), not 3 (the minimum of their largest), and
// restore it from their own records.
TEST(StorageControllerSidecars, TpRanksAgreeOnTheLargestLengthInTheIntersection) {
  auto prefetch_group = InProcessGroup::make_ranks(2, std::chrono::seconds(30));
  auto backup_group = InProcessGroup::make_ranks(2, std::chrono::seconds(30));
  auto main_group = InProcessGroup::make_ranks(2, std::chrono::seconds(30));
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int i = 0; i < 2; ++i) {
    KeyNamespace keys = ns();
    keys.tp_rank = i;
    keys.tp_size = 2;
    ranks.push_back(std::make_unique<Rank>(str_cat("tp", i), *prefetch_group[i], *backup_group[i],
                                           *main_group[i], keys));
  }
  const auto tokens = tokens_for(4, 5);
  // Each rank backs up its own shard (the ranks reduce each backup's stored prefix: in threads).
  std::vector<std::thread> threads;
  std::int64_t stored[2] = {0, 0};
  PrefetchResult res[2];
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      // Checkpoints after pages 2, 4 (rank 0) and 2, 3 (rank 1); the KV keys are each rank's.
      Rank& r = *ranks[static_cast<std::size_t>(i)];
      Slots kv = r.host.alloc(4 * kPage).value();
      for (int p = 0; p < 4; ++p) fill_page(r.host.layout(), kv[p * kPage] / kPage, kv_seed(p));
      const Slots state_pages = i == 0 ? Slots{1, 3} : Slots{1, 2};
      SidecarPagesIo st{.pool = kState, .pages = state_pages,
                        .host_slots = r.state.host_pool().alloc(2).value()};
      for (std::size_t k = 0; k < 2; ++k) {
        fill_page(r.state.host_pool().layout(), st.host_slots[k], seed(kState, state_pages[k], i));
      }
      SidecarPagesIo ix{.pool = kIndex, .pages = {0, 1, 2, 3},
                        .host_slots = r.index.host_pool().alloc(4 * kPage).value()};
      for (std::size_t k = 0; k < 4; ++k) {
        fill_page(r.index.host_pool().layout(), ix.host_slots[k * kPage] / kPage,
                  seed(kIndex, static_cast<std::int64_t>(k), i));
      }
      KeyNamespace keys = ns();
      keys.tp_rank = i;
      keys.tp_size = 2;
      PageKeyer keyer(keys);
      std::vector<std::string> kv_keys;
      keyer.keys(tokens, nullptr, kv_keys);
      const SidecarPagesIo side[] = {st, ix};
      r.c->write_storage(kv, kv_keys, side);
      std::vector<BackupAck> acks;
      while (acks.empty()) {
        if (r.c->drain_backup_acks(acks) == 0) std::this_thread::yield();
      }
      stored[i] = acks[0].completed_tokens;
      r.host.free(kv);
      r.state.host_pool().free(st.host_slots);
      r.index.host_pool().free(ix.host_slots);
      res[i] = prefetch(r, tokens, i);
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(stored[i], 4 * kPage) << "rank " << i;
    EXPECT_EQ(res[i].tokens, 2 * kPage) << "rank " << i;
    EXPECT_EQ(pages_of(res[i], kState), (Slots{1})) << "rank " << i;
  }
}

// TP: a rank whose own pool could not reserve a prefetch's sidecar pages passes none; it still
// makes every collective call, with no hit, so the ranks agree on nothing and both revoke the
// prefetch (no divergence), and every reservation goes back.
TEST(StorageControllerSidecars, ARankWithoutItsReservationRevokesThePrefetchOnEveryRank) {
  std::shared_ptr<InProcessGroup> pg, bg, mg;
  auto prefetch_group = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &pg);
  auto backup_group = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &bg);
  auto main_group = InProcessGroup::make_ranks(2, std::chrono::seconds(30), &mg);
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int i = 0; i < 2; ++i) {
    KeyNamespace keys = ns();
    keys.tp_rank = i;
    keys.tp_size = 2;
    ranks.push_back(std::make_unique<Rank>(str_cat("short", i), *prefetch_group[i],
                                           *backup_group[i], *main_group[i], keys));
  }
  const auto tokens = tokens_for(4, 8);
  bool revoked[2] = {false, false};
  std::int64_t leftover[2] = {-1, -1};
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      Rank& r = *ranks[static_cast<std::size_t>(i)];
      // What L3 holds is the same on both ranks: only the reservation differs.
      Slots kv = r.host.alloc(4 * kPage).value();
      for (int p = 0; p < 4; ++p) fill_page(r.host.layout(), kv[p * kPage] / kPage, kv_seed(p));
      SidecarPagesIo st{.pool = kState, .pages = {3}, .host_slots = r.state.host_pool().alloc(1).value()};
      SidecarPagesIo ix{.pool = kIndex, .pages = {0, 1, 2, 3},
                        .host_slots = r.index.host_pool().alloc(4 * kPage).value()};
      KeyNamespace keys = ns();
      keys.tp_rank = i;
      keys.tp_size = 2;
      PageKeyer keyer(keys);
      std::vector<std::string> kv_keys;
      keyer.keys(tokens, nullptr, kv_keys);
      const SidecarPagesIo side[] = {st, ix};
      r.c->write_storage(kv, kv_keys, side);
      std::vector<BackupAck> acks;
      while (acks.empty()) {
        if (r.c->drain_backup_acks(acks) == 0) std::this_thread::yield();
      }
      r.host.free(kv);
      r.state.host_pool().free(st.host_slots);
      r.index.host_pool().free(ix.host_slots);
      const std::int64_t before = r.free_all();
      Slots into = r.host.alloc(4 * kPage).value();
      std::vector<SidecarPagesIo> reserve = {
          {.pool = kState, .pages = {}, .host_slots = i == 1 ? Slots{} : r.state.host_pool().alloc(1).value()},
          {.pool = kIndex, .pages = {}, .host_slots = r.index.host_pool().alloc(4 * kPage).value()}};
      auto op = r.c->prefetch_into("short", tokens, std::nullopt, into, reserve);
      ASSERT_TRUE(op);
      while (!r.c->can_terminate(*op)) std::this_thread::yield();
      const PrefetchResult res = r.c->terminate_prefetch(*op);
      revoked[i] = res.revoked;
      leftover[i] = before - r.free_all();
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(revoked[i]) << "rank " << i;
    EXPECT_EQ(leftover[i], 0) << "rank " << i << ": a reserved slot not freed";
  }
  EXPECT_EQ(pg->divergence() + bg->divergence() + mg->divergence(), "");
}

// Bad sidecar arguments are refused at the call, naming what is wrong, and change nothing.
TEST(StorageControllerSidecars, BadSidecarArgumentsAreRefusedAndChangeNothing) {
  LocalCollective local;
  Rank r("bad", local, local, local);
  const auto tokens = tokens_for(2, 6);
  Slots kv = r.host.alloc(2 * kPage).value();
  const auto keys = keys_of(tokens);
  Slots st = r.state.host_pool().alloc(1).value();
  auto refused = [&](std::vector<SidecarPagesIo> side, const std::string& says) {
    try {
      r.c->write_storage(kv, keys, side);
      ADD_FAILURE() << "accepted: " << says;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused({{.pool = 2, .pages = {0}, .host_slots = st}}, "sidecar pool 2 is not one of the 2");
  refused({{.pool = kState, .pages = {0}, .host_slots = st}, {.pool = kState, .pages = {1}, .host_slots = st}},
          "or is given twice");
  refused({{.pool = kState, .pages = {2}, .host_slots = st}}, "page 2 out of order or outside");
  refused({{.pool = kState, .pages = {0, 1}, .host_slots = st}}, "1 host pages for 2 pages");
  EXPECT_THROW(r.c->prefetch("plain", tokens), InvalidArgument);
  const std::int64_t free_before = r.free_all();
  EXPECT_THROW(r.c->prefetch_into("few", tokens, std::nullopt, kv), InvalidArgument);
  const SidecarPagesIo wrong[] = {{.pool = kState, .pages = {}, .host_slots = st},
                                  {.pool = kState, .pages = {}, .host_slots = st}};
  EXPECT_THROW(r.c->prefetch_into("twice", tokens, std::nullopt, kv, wrong), InvalidArgument);
  EXPECT_EQ(r.free_all(), free_before);
  r.host.free(kv);
  r.state.host_pool().free(st);
}

}  // namespace
}  // namespace hicache
