#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <filesystem>

#include "storage/collective.h"
#include "transfer/errors.h"

namespace hicache {
namespace {

class GlooCollective final : public Collective {
 public:
  explicit GlooCollective(const GlooConfig& c) : config_(c) {
    gloo::transport::tcp::attr attr;
    attr.hostname = c.hostname;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore file_store(c.store_dir);
    gloo::rendezvous::PrefixStore store(c.prefix, file_store);
    context_ = std::make_shared<gloo::rendezvous::Context>(c.rank, c.size);
    context_->setTimeout(c.timeout);
    context_->connectFullMesh(store, device);
  }

  int rank() const override { return config_.rank; }
  int size() const override { return config_.size; }
  std::string_view name() const override { return "gloo"; }

 protected:
  std::string reduce_min(std::span<std::int64_t> buffer) override {
    try {
      gloo::AllreduceOptions opts(context_);
      opts.setOutput(buffer.data(), buffer.size());
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, std::size_t)>(
              &gloo::min<std::int64_t>));
      opts.setTag(tag_++);
      opts.setTimeout(config_.timeout);
      gloo::allreduce(opts);
    } catch (const std::exception& e) {
      return str_cat("gloo: ", e.what());
    }
    return {};
  }

 private:
  GlooConfig config_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::uint32_t tag_ = 0;
};

}  // namespace

std::unique_ptr<Collective> make_gloo_collective(const GlooConfig& config) {
  if (config.size < 1 || config.rank < 0 || config.rank >= config.size) {
    throw InvalidArgument(str_cat("gloo collective: rank ", config.rank, " outside [0, size ",
                                  config.size, ")"));
  }
  if (config.timeout.count() <= 0) {
    throw InvalidArgument(str_cat("gloo collective: timeout ", config.timeout.count(), " ms"));
  }
  std::error_code ec;
  std::filesystem::create_directories(config.store_dir, ec);
  if (config.store_dir.empty() || !std::filesystem::is_directory(config.store_dir)) {
    throw InvalidArgument(str_cat("gloo collective: store_dir '", config.store_dir,
                                  "' is not a directory"));
  }
  try {
    return std::make_unique<GlooCollective>(config);
  } catch (const std::exception& e) {
    throw Error(str_cat("gloo collective: rank ", config.rank, " of ", config.size,
                        " could not connect: ", e.what()));
  }
}

}  // namespace hicache
