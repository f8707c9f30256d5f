// Read-only memory map of a whole file. Checkpoints are mapped, never copied.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace gemstage {

class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // A descriptor of the same file for pread of scattered rows (WeightView::file). It is a
  // separate open file, told to expect random reads, so its lack of readahead does not slow
  // the mapping's sequential faults, which share the first open's readahead state.
  int row_fd() const { return row_fd_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  int row_fd_ = -1;
  int slot_ = -1;  // in the table check_mapped_files() reads
};

// Files that change underneath. A mapping stays valid when its file is replaced by rename (the
// old inode lives on), but a file truncated or rewritten in place makes every access past its
// new end a SIGBUS. Every MappedFile is listed in a process-wide table so that:
//  - check_mapped_files() can refuse work up front: it throws an Error naming the first mapped
//    file that is now shorter than its mapping (callers such as the server run it before each
//    request);
//  - install_mapped_file_fault_handler() turns a SIGBUS inside a listed mapping (a truncation
//    that races with a read) into a message naming the file and exit code
//    kMappedFileChangedExit instead of a bare "Bus error". Faults anywhere else keep the
//    default action.
constexpr int kMappedFileChangedExit = 74;  // EX_IOERR in sysexits.h
void check_mapped_files();
void install_mapped_file_fault_handler();

// Whole small file into memory (config.json, tokenizer.json, .npy). Refuses files over max_bytes.
std::string read_text_file(const std::string& path, size_t max_bytes = size_t{1} << 30);

}  // namespace gemstage
