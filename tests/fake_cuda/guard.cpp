// Registers c10's FakeGuardImpl as the device guard for DeviceType::CUDA, so that a CPU-only
// build of torch can place (fake) tensors on `cuda` devices: device guards, indexing and
// other ops that consult the guard stop failing with "not linked with support for cuda
// devices". Built at test time by tests/fake_cuda/guard.py; never committed as a binary.
#include <c10/core/impl/FakeGuardImpl.h>

using Guard = c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>;

C10_REGISTER_GUARD_IMPL(CUDA, Guard);

// The current fake device of the calling thread (what torch.cuda.set_device/current_device do).
extern "C" int ringserve_fake_cuda_get_device() { return Guard::getDeviceIndex(); }
extern "C" void ringserve_fake_cuda_set_device(int index) {
  Guard::setDeviceIndex(static_cast<c10::DeviceIndex>(index));
}
