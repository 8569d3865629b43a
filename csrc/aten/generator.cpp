// The tpu random generator: a seed and an offset (like CUDA's Philox
// generator). Each random op reads (seed, offset) as the key and counter of
// its THREE_FRY state and advances the offset by the number of values it
// draws, so torch.manual_seed(s) makes tpu random ops reproducible.
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/Utils.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/core/TensorImpl.h>

#include <array>
#include <cstring>
#include <mutex>
#include <vector>

#include "aten/tpu.h"
#include "runtime/runtime.h"

namespace torch_tpu::aten {
namespace {

constexpr uint64_t kDefaultSeed = 67280421310721ULL;  // CUDA's default seed

// Runs the recorded region, if any (a passed-through or empty one draws
// nothing later: no executor lock, no sync-point bookkeeping; DTensor's
// RNG tracker reads and writes the state around every random op).
void RunRecordedDraws() {
  if (runtime::HasPendingWork()) runtime::FlushPendingWork();
}

// Its state accessors (setting the seed, the offset, get/set_state, clone)
// run the recorded fused region first: the region's random calls draw when
// it runs (DrawRngState at the launch), so without that a state read in
// fused mode missed them (torch.tpu.get_rng_state() after a dropout: the
// offset before it, and restoring that state replayed the same mask; a
// torch.utils.checkpoint recompute drew other values than the forward) and
// a state written (manual_seed, set_rng_state) changed draws recorded
// before it. Draws take the generator's own lock, not at::Generator's
// mutex(): PyTorch holds that one around get_state() (THPGenerator), and
// the flush draws on the same thread.
struct TpuGeneratorImpl final : c10::GeneratorImpl {
  explicit TpuGeneratorImpl(c10::DeviceIndex index)
      : c10::GeneratorImpl(c10::Device(kTpu, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)) {}

  void set_current_seed(uint64_t seed) override {
    RunRecordedDraws();
    SeedUnflushed(seed);
  }
  // The seed only (recorded draws move the offset, never the seed): no flush.
  uint64_t current_seed() const override {
    std::lock_guard<std::mutex> lock(state_mutex_);
    return seed_;
  }
  uint64_t seed() override {
    const uint64_t seed = c10::detail::getNonDeterministicRandom(true);
    set_current_seed(seed);
    return seed;
  }
  // Seeds a generator nothing has drawn from yet (DefaultGenerator, as it
  // creates them): running the recorded region here would ask for the
  // default generator being created (a deadlock in std::call_once).
  void SeedUnflushed(uint64_t seed) {
    std::lock_guard<std::mutex> lock(state_mutex_);
    seed_ = seed;
    offset_ = 0;
  }
  void set_offset(uint64_t offset) override {
    RunRecordedDraws();
    std::lock_guard<std::mutex> lock(state_mutex_);
    offset_ = offset;
  }
  uint64_t get_offset() const override {
    RunRecordedDraws();
    std::lock_guard<std::mutex> lock(state_mutex_);
    return offset_;
  }

  // State: 16 bytes, seed then offset (uint8 CPU tensor, as CUDA's).
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    RunRecordedDraws();
    auto state = at::empty({16}, at::TensorOptions().dtype(at::kByte));
    uint64_t v[2];
    {
      std::lock_guard<std::mutex> lock(state_mutex_);
      v[0] = seed_;
      v[1] = offset_;
    }
    std::memcpy(state.data_ptr(), v, sizeof(v));
    return state.getIntrusivePtr();
  }
  void set_state(const c10::TensorImpl& new_state) override {
    TORCH_CHECK(new_state.numel() == 16 && new_state.dtype() == caffe2::TypeMeta::Make<uint8_t>(),
                "tpu RNG state must be a uint8 tensor of 16 bytes, got ", new_state.numel(), " elements");
    uint64_t v[2];
    std::memcpy(v, new_state.data(), sizeof(v));
    RunRecordedDraws();
    std::lock_guard<std::mutex> lock(state_mutex_);
    seed_ = v[0];
    offset_ = v[1];
  }
  static c10::DeviceType device_type() { return kTpu; }

  // A launch's draw (runtime::DrawRngState): no flush (it is the flush's).
  std::array<uint64_t, 2> Draw(uint64_t increment) {
    std::lock_guard<std::mutex> lock(state_mutex_);
    std::array<uint64_t, 2> state{seed_, offset_};
    offset_ += increment;
    return state;
  }

 private:
  TpuGeneratorImpl* clone_impl() const override {
    RunRecordedDraws();
    auto* g = new TpuGeneratorImpl(device().index());
    std::lock_guard<std::mutex> lock(state_mutex_);
    g->seed_ = seed_;
    g->offset_ = offset_;
    return g;
  }
  mutable std::mutex state_mutex_;
  uint64_t seed_ = kDefaultSeed;
  uint64_t offset_ = 0;
};

std::array<uint64_t, 2> DrawFromTpuGenerator(c10::GeneratorImpl& gen, uint64_t increment) {
  auto* tpu = dynamic_cast<TpuGeneratorImpl*>(&gen);
  TORCH_CHECK(tpu != nullptr, "tpu: a random op's generator is not a tpu generator (device ", gen.device().str(), ")");
  return tpu->Draw(increment);
}

[[maybe_unused]] const bool draw_hook_set = (runtime::SetRngDrawHook(&DrawFromTpuGenerator), true);

}  // namespace

namespace {
std::once_flag generators_once;
std::vector<at::Generator> generators;
std::mutex pending_mutex;
bool have_pending_seed = false;
uint64_t pending_seed = 0;
}  // namespace

const at::Generator& DefaultGenerator(c10::DeviceIndex index) {
  std::call_once(generators_once, [] {
    c10::DeviceIndex n = std::max<c10::DeviceIndex>(DeviceCount(), 1);
    std::lock_guard<std::mutex> lock(pending_mutex);
    for (c10::DeviceIndex i = 0; i < n; ++i) {
      generators.push_back(at::make_generator<TpuGeneratorImpl>(i));
      if (have_pending_seed) generators.back().get<TpuGeneratorImpl>()->SeedUnflushed(pending_seed);
    }
  });
  if (index < 0) index = CurrentDevice();
  TORCH_CHECK(index < static_cast<c10::DeviceIndex>(generators.size()), "tpu device index ",
              static_cast<int>(index), " out of range");
  return generators[static_cast<size_t>(index)];
}

void SeedAllDefaultGenerators(uint64_t seed) {
  {
    std::lock_guard<std::mutex> lock(pending_mutex);
    if (generators.empty() && !runtime::Runtime::Initialized()) {
      have_pending_seed = true;
      pending_seed = seed;
      return;
    }
  }
  for (c10::DeviceIndex i = 0; i < std::max<c10::DeviceIndex>(DeviceCount(), 1); ++i) {
    at::Generator g = DefaultGenerator(i);  // a handle on the same generator
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_current_seed(seed);
  }
}

at::Generator NewGenerator(c10::DeviceIndex index) {
  return at::make_generator<TpuGeneratorImpl>(index < 0 ? CurrentDevice() : index);
}

}  // namespace torch_tpu::aten
