// Writing files that must never be seen half-written (bundle exports, see stage/bundle_export.cc).
//
// FileWriter writes through a plain descriptor so a failed write reports errno (EFBIG, ENOSPC,
// EIO) with the file's name instead of a stream's silent failbit; commit() flushes, syncs the
// data to disk and closes. Callers write under a temporary name and rename_into_place() only
// once the file is complete, so a reader never finds a final name that is short.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace gemstage {

class FileWriter {
 public:
  FileWriter() = default;
  explicit FileWriter(const std::string& path) { open(path); }
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  // Creates or truncates path.
  void open(const std::string& path);
  void write(const void* data, size_t n);
  void write(const std::string& s) { write(s.data(), s.size()); }
  // Flushes the buffer, syncs the data (core/platform.h: fdatasync on Linux) and closes; errors
  // name the file and the errno text.
  void commit();
  const std::string& path() const { return path_; }

 private:
  void flush_buffer();
  [[noreturn]] void fail_errno(const char* what, int err);

  std::string path_;
  int fd_ = -1;
  std::vector<char> buf_;
  size_t used_ = 0;
  uint64_t written_ = 0;
};

// Writes the whole of contents to path through FileWriter (created or truncated, synced).
void write_file_synced(const std::string& path, const std::string& contents);
// rename(2) from -> to (same folder, so atomic); errors name both files.
void rename_into_place(const std::string& from, const std::string& to);
// fsync of a folder, so renames inside it survive a crash; failures are ignored where the file
// system cannot sync folders (the renames themselves already happened).
void sync_dir(const std::string& dir);

}  // namespace gemstage
