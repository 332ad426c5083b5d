// FileStorage on a root that several instances use, with no "shared" key in their configs: each
// finds out that another is live and then sees its records (docs/configuration.md, "shared").
// The two-process cases run each store in a child process of its own (fork, before any store
// exists in the parent), driven one command at a time through pipes.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <memory>

#include "pools/kv_pattern.h"
#include "storage/file_storage.h"
#include "storage/peer_process.h"
#include "transfer/errors.h"

namespace hicache {
namespace {

namespace fs = std::filesystem;

constexpr std::size_t kBytes = 16 << 10;

std::uint64_t seed_of(const std::string& key) { return std::hash<std::string>{}(key); }

std::vector<std::string> make_keys(const std::string& stem, int n) {
  std::vector<std::string> keys;
  for (int i = 0; i < n; ++i) keys.push_back(str_cat(stem, "-", i));
  return keys;
}

// Stores `keys`, each page a pattern of its key; true when every one is stored.
bool put(StorageBackend& s, const std::vector<std::string>& keys) {
  std::vector<std::vector<std::byte>> pages(keys.size(), std::vector<std::byte>(kBytes));
  std::vector<ConstByteSpan> spans;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    fill_pattern(pages[i], seed_of(keys[i]), 0, 0);
    spans.emplace_back(pages[i]);
  }
  for (const auto& r : s.batch_set(keys, spans)) {
    if (!r.is_ok()) return false;
  }
  return true;
}

// Reads `keys`: per key, 1 when read and holding exactly its key's page, 0 for a miss, -1 for
// anything else (an error, or wrong bytes reported ok).
std::vector<int> read(StorageBackend& s, const std::vector<std::string>& keys) {
  std::vector<std::vector<std::byte>> pages(keys.size(), std::vector<std::byte>(kBytes));
  std::vector<ByteSpan> spans;
  for (auto& p : pages) spans.emplace_back(p);
  const auto results = s.batch_get(keys, spans);
  std::vector<int> out;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (results[i].status == IoStatus::kMiss) {
      out.push_back(0);
    } else {
      out.push_back(
          results[i].is_ok() && find_pattern_mismatch(pages[i], seed_of(keys[i]), 0, 0) < 0 ? 1
                                                                                            : -1);
    }
  }
  return out;
}

using Peer = testing::PeerProcess;

class FileStorageSharedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = fs::temp_directory_path() / str_cat("hicache-shared-", info->name(), "-", ::getpid());
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  // No "shared" key: what every engine gets by default.
  FileStorageConfig config() const { return {.root = root_.string(), .io_threads = 2}; }

  fs::path root_;
};

// The proof of issue 38's first point, in two processes: B opens the root first (alone), asks for
// A's keys before A writes them (absent: remembered), then finds every page A stores and reads
// its bytes; a record A removes is a miss in B, never stale or wrong bytes, and the others still
// read right. Neither config says "shared".
TEST_F(FileStorageSharedTest, TwoProcessesWithoutASharedKeySeeEachOthersRecords) {
  const auto keys = make_keys("two", 4);
  const FileStorageConfig c = config();
  std::unique_ptr<FileStorage> store;  // each child's own copy
  auto open = [&] { store = std::make_unique<FileStorage>(c); };
  Peer b([&](char cmd) -> char {
    switch (cmd) {
      case 'o':
        open();
        return '+';
      case '0':
        return store->batch_exists(keys) == 0 ? '+' : '-';
      case 'n': {
        if (store->batch_exists(keys) != keys.size()) return '-';
        const auto r = read(*store, keys);
        return r == std::vector<int>(keys.size(), 1) ? '+' : '-';
      }
      case 'm': {  // after A removed keys[1]
        if (store->batch_exists(keys) != 1) return '-';
        const auto r = read(*store, keys);
        return r == std::vector<int>{1, 0, 1, 1} ? '+' : '-';
      }
      default:
        return '?';
    }
  });
  ASSERT_EQ(b.ask('o'), '+');
  ASSERT_EQ(b.ask('0'), '+') << "B alone, nothing stored";
  Peer a([&](char cmd) -> char {
    switch (cmd) {
      case 'o':
        open();
        return '+';
      case 'w':
        return put(*store, keys) ? '+' : '-';
      case 'r': {
        const bool removed = store->remove(keys[1]);
        store->flush_trash();
        return removed ? '+' : '-';
      }
      case 'c':
        store.reset();
        return '+';
      default:
        return '?';
    }
  });
  ASSERT_EQ(a.ask('o'), '+');
  EXPECT_EQ(b.ask('0'), '+') << "B beside A, before A wrote: remembered absent";
  ASSERT_EQ(a.ask('w'), '+');
  EXPECT_EQ(b.ask('n'), '+') << "B does not see (or misreads) the pages A wrote after B opened";
  ASSERT_EQ(a.ask('r'), '+');
  EXPECT_EQ(b.ask('m'), '+') << "B answers stale or wrong data for a record A removed";
  ASSERT_EQ(a.ask('c'), '+');
  EXPECT_EQ(b.ask('m'), '+') << "B alone again: what it adopted is still right";
}

// The same rule in one process (two instances are two opens of the root): a key asked for and
// found absent is asked of the disk again once the other instance has published a record.
TEST_F(FileStorageSharedTest, AKeyRememberedAbsentIsFoundOnceAnotherInstancePublishes) {
  FileStorage b(config());
  FileStorage a(config());
  const auto first = make_keys("first", 3), later = make_keys("later", 2);
  EXPECT_EQ(b.batch_exists(first), 0u);
  EXPECT_EQ(b.batch_exists(later), 0u);
  ASSERT_TRUE(put(a, first));
  EXPECT_EQ(b.batch_exists(first), first.size());
  // B's own writes leave its memory of absent keys as it is; A's next write clears it.
  ASSERT_TRUE(put(b, make_keys("own", 2)));
  EXPECT_EQ(b.batch_exists(later), 0u);
  ASSERT_TRUE(put(a, later));
  EXPECT_EQ(read(b, later), std::vector<int>(later.size(), 1)) << "read without exists first";
  EXPECT_EQ(b.batch_exists(later), later.size());
}

// Alone again (the other instance closed), a store answers from its index: a record that appears
// on disk behind its back is not looked up. (This is what "shared": true changes.)
TEST_F(FileStorageSharedTest, AStoreAloneAgainAnswersFromItsIndex) {
  FileStorage b(config());
  const auto keys = make_keys("k", 2);
  {
    FileStorage a(config());
    ASSERT_TRUE(put(a, {keys[0]}));
    EXPECT_EQ(b.batch_exists(std::vector<std::string>{keys[0]}), 1u);
  }
  fs::copy_file(root_ / keys[0], root_ / keys[1]);  // not a valid record of keys[1]: never read
  EXPECT_EQ(b.batch_exists(keys), 1u) << "alone, the store still asks the disk";
  auto forced = config();
  forced.shared = true;
  FileStorage c(forced);
  EXPECT_EQ(c.batch_exists(keys), 2u);
  EXPECT_EQ(read(c, keys), (std::vector<int>{1, 0})) << "a foreign record is a miss";
}

// Alone again after the other instance removed a record that this one had indexed: the entry is
// asked of the disk once more, so the store neither reports the record stored nor deduplicates a
// write of it into nothing (a backup that would never be written).
TEST_F(FileStorageSharedTest, AloneAgainAfterAnotherInstanceRemovedARecordTheIndexIsCheckedOnce) {
  FileStorage b(config());
  const auto keys = make_keys("gone", 2);
  {
    FileStorage a(config());
    ASSERT_TRUE(put(a, keys));
    ASSERT_EQ(b.batch_exists(keys), keys.size());  // adopted into b's index
    ASSERT_TRUE(a.remove(keys[0]));
  }
  EXPECT_EQ(b.batch_exists(keys), 0u) << "alone again, b still listed the removed record";
  ASSERT_TRUE(put(b, keys));
  EXPECT_EQ(read(b, keys), std::vector<int>(keys.size(), 1)) << "the write was deduplicated away";
  EXPECT_EQ(b.batch_exists(keys), keys.size());
}

// Shared, an indexed record is asked of the disk again only after another instance took a record
// out of the root: B trusts what it found while nothing was removed, asks again after A's
// removal, and finds the removed record gone. A record deleted behind every instance's back (by
// hand) may still be reported present: its read is a miss, never other bytes, and then it is
// gone from the index.
TEST_F(FileStorageSharedTest, IndexedRecordsAreAskedAgainAfterAnotherInstanceRemoves) {
  FileStorage a(config()), b(config());
  const auto keys = make_keys("r", 3);
  ASSERT_TRUE(put(a, keys));
  ASSERT_EQ(b.batch_exists(keys), keys.size());
  ASSERT_TRUE(a.remove(keys[1]));
  EXPECT_EQ(b.batch_exists(keys), 1u);
  EXPECT_EQ(read(b, keys), (std::vector<int>{1, 0, 1}));
  const std::vector<std::string> last{keys[2]};
  EXPECT_EQ(b.batch_exists(last), 1u);  // found on disk again, after the removal
  fs::remove(root_ / keys[2]);          // by hand: no instance counts it
  EXPECT_EQ(b.batch_exists(last), 1u) << "trusted: no instance removed a record since";
  EXPECT_EQ(read(b, last), std::vector<int>{0});
  EXPECT_EQ(b.batch_exists(last), 0u);
}

// "shared": false promises the root to one instance: it refuses to open beside a live instance,
// and every other instance refuses to open beside it, naming the root; a refused open leaves the
// root as it was. Its lock dies with its process.
TEST_F(FileStorageSharedTest, SharedFalseTakesTheRootToItselfOrRefuses) {
  auto alone = config();
  alone.shared = false;
  {
    FileStorage live(config());
    ASSERT_TRUE(put(live, make_keys("kept", 2)));
    try {
      FileStorage refused(alone);
      ADD_FAILURE() << "\"shared\": false opened beside a live instance";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find(root_.string()), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("\"shared\": false"), std::string::npos) << e.what();
    }
    EXPECT_EQ(live.batch_exists(make_keys("kept", 2)), 2u);
  }
  {
    FileStorage owner(alone);
    EXPECT_THROW(FileStorage{config()}, IoError);
    auto forced = config();
    forced.shared = true;
    EXPECT_THROW(FileStorage{forced}, IoError);
    EXPECT_THROW(FileStorage{alone}, IoError);
    EXPECT_EQ(owner.batch_exists(make_keys("kept", 2)), 2u);
  }
  // An owner that dies (SIGKILL) frees the root.
  std::unique_ptr<FileStorage> store;
  Peer owner([&](char) -> char {
    store = std::make_unique<FileStorage>(alone);
    return '+';
  });
  ASSERT_EQ(owner.ask('o'), '+');
  EXPECT_THROW(FileStorage{config()}, IoError);
  owner.kill();
  FileStorage after(config());
  EXPECT_EQ(after.batch_exists(make_keys("kept", 2)), 2u);
}

// An instance that dies counted leaves the survivors shared (they cannot prove they are alone):
// a survivor still sees a later instance's records. A start that finds no other live instance
// counts again, and answers from its index. (Every child is forked before the parent opens a
// store: a fork copies no threads.)
TEST_F(FileStorageSharedTest, AnInstanceThatDiedLeavesTheSurvivorShared) {
  std::unique_ptr<FileStorage> store;
  const FileStorageConfig c = config();
  const auto keys = make_keys("after-crash", 2);
  Peer doomed([&](char) -> char {
    store = std::make_unique<FileStorage>(c);
    return '+';
  });
  Peer writer([&](char) -> char {
    FileStorage w(c);
    return put(w, keys) ? '+' : '-';
  });
  auto survivor = std::make_unique<FileStorage>(config());
  ASSERT_EQ(doomed.ask('o'), '+');
  doomed.kill();
  EXPECT_EQ(survivor->batch_exists(keys), 0u);
  ASSERT_EQ(writer.ask('w'), '+');  // opens, writes and closes
  EXPECT_EQ(survivor->batch_exists(keys), keys.size());
  EXPECT_EQ(read(*survivor, keys), std::vector<int>(keys.size(), 1));
  survivor.reset();
  // Without the snapshot the last close wrote: its background check would index what is planted.
  fs::remove(root_ / ".index");
  FileStorage fresh(config());
  fs::copy_file(root_ / keys[0], root_ / "planted");
  EXPECT_EQ(fresh.batch_exists(std::vector<std::string>{"planted"}), 0u)
      << "a lone start left the dead instance counted";
}

}  // namespace
}  // namespace hicache
