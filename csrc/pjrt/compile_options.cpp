// CompileOptions::Serialize: a hand-encoded xla.CompileOptionsProto.
//
// Field numbers from xla/pjrt/proto/compile_options.proto (openxla/xla):
//   CompileOptionsProto
//     3  executable_build_options : ExecutableBuildOptionsProto
//     4  compile_portable_executable : bool
//     7  env_option_overrides     : map<string, OptionOverrideProto>
//        (on the wire: repeated entry message { 1 key : string,
//                                               2 value : OptionOverrideProto })
//   ExecutableBuildOptionsProto
//     4  num_replicas   : int64
//     5  num_partitions : int64
//     9  device_assignment : DeviceAssignmentProto
//   DeviceAssignmentProto (xla/xla_data.proto)
//     1  replica_count : int32
//     2  computation_count : int32
//     3  computation_devices : repeated ComputationDevice
//          { 1 replica_device_ids : repeated int64 }
//   OptionOverrideProto (oneof value)
//     1  string_field : string
//     2  bool_field   : bool
//     (3 int_field : int64, 4 double_field : double: unused; XLA parses string
//      values according to the DebugOptions field's type.)
//
// The CPU plugin aborts on an empty options string, so executable_build_options
// is always written, with explicit num_replicas/num_partitions. Entries are
// written in the order given, so equal options serialize to equal bytes.
#include <cstdint>
#include <string>

#include "pjrt.h"

namespace torch_tpu::pjrt {
namespace {

enum WireType : uint32_t { kVarint = 0, kLengthDelimited = 2 };

void PutVarint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void PutTag(std::string& out, uint32_t field, WireType type) {
  PutVarint(out, (static_cast<uint64_t>(field) << 3) | type);
}

void PutInt(std::string& out, uint32_t field, int64_t v) {
  PutTag(out, field, kVarint);
  PutVarint(out, static_cast<uint64_t>(v));  // int64: two's complement
}

void PutBytes(std::string& out, uint32_t field, std::string_view bytes) {
  PutTag(out, field, kLengthDelimited);
  PutVarint(out, bytes.size());
  out.append(bytes);
}

}  // namespace

std::string CompileOptions::Serialize() const {
  std::string build;  // ExecutableBuildOptionsProto
  PutInt(build, 4, num_replicas);
  PutInt(build, 5, num_partitions);
  if (!device_assignment.empty()) {
    if (num_partitions != 1 || static_cast<int64_t>(device_assignment.size()) != num_replicas)
      throw Error("CompileOptions: device_assignment needs num_partitions 1 and one device per replica (" +
                      std::to_string(device_assignment.size()) + " devices, " + std::to_string(num_replicas) +
                      " replicas)",
                  PJRT_Error_Code_INVALID_ARGUMENT);
    std::string computation;  // ComputationDevice (partition 0)
    for (int64_t id : device_assignment) PutInt(computation, 1, id);
    std::string assignment;  // DeviceAssignmentProto
    PutInt(assignment, 1, num_replicas);
    PutInt(assignment, 2, 1);
    PutBytes(assignment, 3, computation);
    PutBytes(build, 9, assignment);
  }

  std::string out;  // CompileOptionsProto
  PutBytes(out, 3, build);
  if (portable) PutInt(out, 4, 1);
  for (const auto& [key, value] : env_option_overrides) {
    std::string override_proto;  // OptionOverrideProto
    if (value == "true" || value == "false") {
      PutInt(override_proto, 2, value == "true" ? 1 : 0);
    } else {
      PutBytes(override_proto, 1, value);
    }
    std::string entry;  // map entry
    PutBytes(entry, 1, key);
    PutBytes(entry, 2, override_proto);
    PutBytes(out, 7, entry);
  }
  return out;
}

}  // namespace torch_tpu::pjrt
