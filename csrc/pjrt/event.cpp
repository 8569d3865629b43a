// PJRT_Event wrapper.
#include "call.h"
#include "pjrt.h"

namespace torch_tpu::pjrt {

Event::Event(std::shared_ptr<Plugin> plugin, PJRT_Event* event)
    : plugin_(std::move(plugin)), event_(event) {}

Event::~Event() {
  if (event_ == nullptr) return;
  PJRT_Event_Destroy_Args args{};
  args.event = event_;
  TORCH_TPU_PJRT_CALL_NOTHROW(*plugin_, PJRT_Event_Destroy, args);
}

void Event::Await() {
  PJRT_Event_Await_Args args{};
  args.event = event_;
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Event_Await, args);
}

bool Event::IsReady() const {
  PJRT_Event_IsReady_Args args{};
  args.event = event_;
  TORCH_TPU_PJRT_CALL(*plugin_, PJRT_Event_IsReady, args);
  return args.is_ready;
}

}  // namespace torch_tpu::pjrt
