// PJRT_LoadedExecutable wrapper: the per-op hot path (Execute).
#include <algorithm>
#include <string>

#include "call.h"
#include "pjrt.h"

namespace torch_tpu::pjrt {
namespace {

void Release(const Plugin& plugin, PJRT_Executable*& executable,
             PJRT_LoadedExecutable*& loaded) noexcept {
  if (executable != nullptr) {
    PJRT_Executable_Destroy_Args args{};
    args.executable = executable;
    TORCH_TPU_PJRT_CALL_NOTHROW(plugin, PJRT_Executable_Destroy, args);
    executable = nullptr;
  }
  if (loaded != nullptr) {
    PJRT_LoadedExecutable_Destroy_Args args{};
    args.executable = loaded;
    TORCH_TPU_PJRT_CALL_NOTHROW(plugin, PJRT_LoadedExecutable_Destroy, args);
    loaded = nullptr;
  }
}

}  // namespace

Executable::Executable(std::shared_ptr<Plugin> plugin,
                       PJRT_LoadedExecutable* exe)
    : plugin_(std::move(plugin)), exe_(exe) {
  try {
    PJRT_LoadedExecutable_GetExecutable_Args get{};
    get.loaded_executable = exe_;
    TORCH_TPU_PJRT_CALL(*plugin_, PJRT_LoadedExecutable_GetExecutable, get);
    executable_ = get.executable;

    PJRT_Executable_NumOutputs_Args num{};
    num.executable = executable_;
    TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Executable_NumOutputs, num);
    num_outputs_ = num.num_outputs;
  } catch (...) {
    Release(*plugin_, executable_, exe_);  // no destructor after a throwing ctor
    throw;
  }
}

Executable::~Executable() { Release(*plugin_, executable_, exe_); }

size_t Executable::num_outputs() const { return num_outputs_; }

namespace {

// A array of T that lives on the stack up to N elements and on the heap
// beyond; keeps Execute free of allocations for ordinary ops.
template <typename T, size_t N>
class SmallArray {
 public:
  explicit SmallArray(size_t n) {
    if (n > N) {
      heap_.resize(n);
      data_ = heap_.data();
    }
  }
  T* data() { return data_; }
  T& operator[](size_t i) { return data_[i]; }

 private:
  T inline_[N];
  std::vector<T> heap_;
  T* data_ = inline_;
};

}  // namespace

std::vector<std::unique_ptr<Buffer>> Executable::Execute(
    std::span<Buffer* const> arguments, const Device& device,
    std::span<const int64_t> donated, std::unique_ptr<Event>* complete) {
  constexpr size_t kInline = 16;
  const size_t num_args = arguments.size();

  SmallArray<PJRT_Buffer*, kInline> args(num_args);
  SmallArray<int64_t, kInline> non_donatable(num_args);
  size_t num_non_donatable = 0;
  for (size_t i = 0; i < num_args; ++i) {
    if (arguments[i] == nullptr) [[unlikely]] {
      throw Error("Execute: argument " + std::to_string(i) + " is null",
                  PJRT_Error_Code_INVALID_ARGUMENT);
    }
    args[i] = arguments[i]->handle();
    const int64_t index = static_cast<int64_t>(i);
    if (donated.empty() ||
        std::find(donated.begin(), donated.end(), index) == donated.end()) {
      non_donatable[num_non_donatable++] = index;
    }
  }

  SmallArray<PJRT_Buffer*, kInline> outputs(num_outputs_);
  std::fill_n(outputs.data(), num_outputs_, nullptr);
  std::vector<std::unique_ptr<Buffer>> result;
  result.reserve(num_outputs_);  // before Execute: nothing to leak if it throws

  PJRT_ExecuteOptions options{};
  options.struct_size = PJRT_ExecuteOptions_STRUCT_SIZE;
  options.non_donatable_input_indices = non_donatable.data();
  options.num_non_donatable_input_indices = num_non_donatable;

  PJRT_Buffer* const* argument_list = args.data();
  PJRT_Buffer** output_list = outputs.data();
  PJRT_Event* complete_event = nullptr;

  PJRT_LoadedExecutable_Execute_Args exec{};
  exec.executable = exe_;
  exec.options = &options;
  exec.argument_lists = &argument_list;
  exec.num_devices = 1;
  exec.num_args = num_args;
  exec.output_lists = &output_list;
  exec.device_complete_events = complete != nullptr ? &complete_event : nullptr;
  exec.execute_device = device.handle;
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_LoadedExecutable_Execute, exec);

  size_t i = 0;
  try {
    if (complete != nullptr) {
      *complete = std::make_unique<Event>(plugin_, complete_event);
      complete_event = nullptr;  // owned by *complete now
    }
    for (; i < num_outputs_; ++i) {
      result.push_back(std::make_unique<Buffer>(plugin_, outputs[i]));
    }
  } catch (...) {  // allocation failure: release what the plugin handed us
    if (complete_event != nullptr) Event(plugin_, complete_event);
    for (; i < num_outputs_; ++i) Buffer(plugin_, outputs[i]);
    throw;
  }
  return result;
}

std::string Executable::Serialize() const {
  PJRT_Executable_Serialize_Args args{};
  args.executable = executable_;
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Executable_Serialize, args);
  struct Deleter {
    PJRT_Executable_Serialize_Args& a;
    ~Deleter() {
      if (a.serialized_executable_deleter != nullptr &&
          a.serialized_executable != nullptr) {
        a.serialized_executable_deleter(a.serialized_executable);
      }
    }
  } deleter{args};
  return std::string(args.serialized_bytes, args.serialized_bytes_size);
}

std::vector<PJRT_Device*> Executable::addressable_devices() const {
  PJRT_LoadedExecutable_AddressableDevices_Args args{};
  args.executable = exe_;
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_LoadedExecutable_AddressableDevices, args);
  return std::vector<PJRT_Device*>(args.addressable_devices, args.addressable_devices + args.num_addressable_devices);
}

std::vector<std::vector<std::unique_ptr<Buffer>>> Executable::ExecuteReplicated(
    std::span<const std::vector<Buffer*>> argument_lists, std::vector<std::unique_ptr<Event>>* complete) {
  const size_t num_devices = argument_lists.size();
  const size_t expected = addressable_devices().size();
  if (num_devices != expected) {
    throw Error("ExecuteReplicated: " + std::to_string(num_devices) + " argument lists for an executable on " +
                    std::to_string(expected) + " devices of this process",
                PJRT_Error_Code_INVALID_ARGUMENT);
  }
  const size_t num_args = num_devices ? argument_lists[0].size() : 0;
  std::vector<std::vector<PJRT_Buffer*>> args(num_devices);
  for (size_t d = 0; d < num_devices; ++d) {
    if (argument_lists[d].size() != num_args)
      throw Error("ExecuteReplicated: argument lists of different lengths", PJRT_Error_Code_INVALID_ARGUMENT);
    for (size_t i = 0; i < num_args; ++i) {
      if (argument_lists[d][i] == nullptr)
        throw Error("ExecuteReplicated: argument " + std::to_string(i) + " of device " + std::to_string(d) +
                        " is null",
                    PJRT_Error_Code_INVALID_ARGUMENT);
      args[d].push_back(argument_lists[d][i]->handle());
    }
  }
  std::vector<int64_t> non_donatable(num_args);
  for (size_t i = 0; i < num_args; ++i) non_donatable[i] = static_cast<int64_t>(i);
  std::vector<PJRT_Buffer* const*> arg_ptrs(num_devices);
  std::vector<std::vector<PJRT_Buffer*>> outputs(num_devices, std::vector<PJRT_Buffer*>(num_outputs_, nullptr));
  std::vector<PJRT_Buffer**> out_ptrs(num_devices);
  for (size_t d = 0; d < num_devices; ++d) {
    arg_ptrs[d] = args[d].data();
    out_ptrs[d] = outputs[d].data();
  }
  std::vector<PJRT_Event*> events(num_devices, nullptr);

  PJRT_ExecuteOptions options{};
  options.struct_size = PJRT_ExecuteOptions_STRUCT_SIZE;
  options.non_donatable_input_indices = non_donatable.data();
  options.num_non_donatable_input_indices = num_args;

  PJRT_LoadedExecutable_Execute_Args exec{};
  exec.executable = exe_;
  exec.options = &options;
  exec.argument_lists = arg_ptrs.data();
  exec.num_devices = num_devices;
  exec.num_args = num_args;
  exec.output_lists = out_ptrs.data();
  exec.device_complete_events = complete != nullptr ? events.data() : nullptr;
  exec.execute_device = nullptr;  // every device of the assignment
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_LoadedExecutable_Execute, exec);

  // Owned from here; wrapping cannot fail but for allocation, and then the
  // destructors of what was wrapped release it.
  std::vector<std::vector<std::unique_ptr<Buffer>>> result(num_devices);
  for (size_t d = 0; d < num_devices; ++d) {
    for (size_t i = 0; i < num_outputs_; ++i) result[d].push_back(std::make_unique<Buffer>(plugin_, outputs[d][i]));
  }
  if (complete != nullptr) {
    complete->clear();
    for (PJRT_Event* e : events) complete->push_back(std::make_unique<Event>(plugin_, e));
  }
  return result;
}

}  // namespace torch_tpu::pjrt
