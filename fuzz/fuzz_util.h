// Helpers shared by the libFuzzer targets (fuzz/CMakeLists.txt).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"

namespace gemstage::fuzz {

// A per-process scratch folder for parsers that take a path (they map the file).
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const auto p =
        std::filesystem::temp_directory_path() / ("gemstage_fuzz_" + std::to_string(::getpid()));
    std::filesystem::create_directories(p);
    return p.string();
  }();
  return dir;
}

inline std::string write_scratch(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = scratch_dir() + "/" + name;
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  return path;
}

// Parsers must refuse bad input with gemstage::Error (a message for the user). Anything else
// escaping - std::out_of_range, nlohmann::json's type_error, a crash - is a finding, so only
// Error is swallowed here and libFuzzer reports the rest as an uncaught exception.
template <typename Fn>
void expect_error_or_success(Fn&& fn) {
  try {
    fn();
  } catch (const gemstage::Error&) {
  }
}

}  // namespace gemstage::fuzz
