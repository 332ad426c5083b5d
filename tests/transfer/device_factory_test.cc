#include <gtest/gtest.h>

#include "transfer/device.h"
#include "transfer/errors.h"

namespace hicache {
namespace {

TEST(DeviceFactory, HostIsAlwaysAvailable) {
  auto device = Device::create("host");
  EXPECT_EQ(device->backend(), DeviceBackend::kHost);
  EXPECT_TRUE(device->device_memory_is_host_accessible());
}

TEST(DeviceFactory, UnknownBackendNamesItAndTheValidOnes) {
  try {
    Device::create("tpu");
    FAIL();
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'tpu'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("\"host\""), std::string::npos) << msg;
  }
}

TEST(DeviceFactory, AutoPicksCudaOnlyWhenAGpuAnswers) {
  std::string why;
  const bool gpu = Device::cuda_available(&why);
  auto device = Device::create("auto");
  EXPECT_EQ(device->backend(), gpu ? DeviceBackend::kCuda : DeviceBackend::kHost) << why;
}

TEST(DeviceFactory, CudaWithoutAGpuFailsWithTheReason) {
  std::string why;
  if (Device::cuda_available(&why)) GTEST_SKIP() << "a GPU is present; the failure path needs none";
  try {
    Device::create("cuda");
    FAIL();
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace hicache
