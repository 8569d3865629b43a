// torch_tpu on-disk executable cache (DESIGN.md, "Executable cache").
//
// Entries are serialized PJRT executables, one file each, named by a 64-bit
// hash and the length of their key (EntryPath). The key is the full text of what determines the executable:
// the StableHLO module, the serialized compile options, the plugin's
// platform, version and attributes, the PJRT API version and the torch_tpu
// version. The key is stored in the entry and compared in full on load, so a
// hash collision can cost a compile but never return a wrong executable.
//
// File layout: "TTPUEXE1\n", u64 key length, key bytes, u64 payload length,
// payload bytes, 40 hex characters of the payload's SHA-1.
// Writes go to a unique temporary file in the same directory, then rename(2)
// it over the entry: readers never see a partial entry and two processes
// writing the same entry both succeed (the last rename wins; both are valid).
// A corrupt, truncated or mismatched entry is reported with a warning,
// recompiled and replaced, never fatal. The directory is bounded in size
// (TORCH_TPU_CACHE_MAX_BYTES, default 2 GiB): past it, the least recently
// used entries (by modification time, touched on every hit) are removed
// until the total is at 90% of the bound. Listing the directory costs a stat per entry (~0.4 s for 43k
// entries on this machine's disk), so it is not done after every write: a
// process scans at its first write, then adds its own writes' sizes to that
// total and scans again (evicting) when the total passes the bound or after
// kRescanWrites writes (other processes' writes and removals are seen
// then). The bound holds after every scan; between scans the directory can
// exceed it by what other processes wrote since this one's last scan.
//
// Not cached: modules with a float8 element type (f8E*), compiled every
// time, so a process's first call of each is host-served (disk_cache.cpp
// BypassesCache says why and why it is a stopgap: the plugin flushes
// subnormals in every execution, loaded or fresh).
//
// Location: TORCH_TPU_CACHE_DIR, else $XDG_CACHE_HOME/torch_tpu, else
// ~/.cache/torch_tpu. TORCH_TPU_CACHE_DIR="" (empty) disables the cache.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "pjrt/pjrt.h"

namespace torch_tpu::runtime {

struct DiskCacheStats {
  // scans: directory listings for the size bound (see above).
  std::atomic<int64_t> hits{0}, misses{0}, writes{0}, errors{0}, evictions{0}, scans{0};
};

class DiskCache {
 public:
  // The process-wide cache (directory from the environment).
  static DiskCache& Get();
  explicit DiskCache(std::string directory, int64_t max_bytes);

  bool enabled() const { return !directory_.empty(); }
  const std::string& directory() const { return directory_; }
  int64_t max_bytes() const { return max_bytes_; }
  DiskCacheStats& stats() { return stats_; }

  // Loads the executable for `module_text` compiled with `options`, or
  // compiles it (and stores it). Never throws for cache problems; compile
  // errors propagate.
  std::unique_ptr<pjrt::Executable> LoadOrCompile(pjrt::Client& client, std::string_view module_text,
                                                  const pjrt::CompileOptions& options);

  // Whether an entry for `module_text` compiled with `options` is on disk
  // (not checked for validity: a bad entry is compiled again on load).
  bool Has(pjrt::Client& client, std::string_view module_text, const pjrt::CompileOptions& options) const;

  // The full key text of a module (exposed for tests).
  static std::string Key(pjrt::Client& client, std::string_view module_text,
                         const pjrt::CompileOptions& options);

 private:
  std::string EntryPath(const std::string& key) const;
  std::unique_ptr<pjrt::Executable> Load(pjrt::Client& client, const std::string& path, const std::string& key);
  // Writes the entry; returns its size in bytes.
  int64_t Store(const std::string& path, const std::string& key, const std::string& payload);
  // After a write of `bytes`: rescans (Evict) when due, see above.
  void Account(int64_t bytes);
  void Evict();

  static constexpr int64_t kRescanWrites = 256;
  std::string directory_;
  int64_t max_bytes_;
  DiskCacheStats stats_;
  // The directory's total at the last scan plus this process's writes since
  // (-1: not scanned yet); guarded by LoadOrCompile's mutex.
  int64_t known_bytes_ = -1;
  int64_t writes_since_scan_ = 0;
};

}  // namespace torch_tpu::runtime
