#include "io/npy.h"

#include <cstring>
#include <fstream>
#include <limits>

#include "core/error.h"
#include "io/mapped_file.h"

namespace gemstage {

namespace {

struct Descr {
  const char* text;
  DType dtype;
};
constexpr Descr kDescrs[] = {{"<f4", DType::F32}, {"<f8", DType::F64}, {"<f2", DType::F16},
                             {"<i8", DType::I64}, {"<i4", DType::I32}, {"|i1", DType::I8},
                             {"|u1", DType::U8},  {"|b1", DType::BOOL}};

// Value of 'key': in a numpy header dict, up to the next ',' or '}' (or the closing ')' of a
// tuple).
std::string header_value(const std::string& h, const std::string& key, const std::string& what) {
  const std::string k = "'" + key + "'";
  const size_t p = h.find(k);
  if (p == std::string::npos) fail(what, ": npy header has no ", k);
  size_t v = h.find(':', p + k.size());
  if (v == std::string::npos) fail(what, ": npy header malformed near ", k);
  ++v;
  while (v < h.size() && h[v] == ' ') ++v;
  if (v < h.size() && h[v] == '(') {
    const size_t e = h.find(')', v);
    if (e == std::string::npos) fail(what, ": npy header: unterminated shape tuple");
    return h.substr(v, e - v + 1);
  }
  size_t e = v;
  while (e < h.size() && h[e] != ',' && h[e] != '}') ++e;
  std::string s = h.substr(v, e - v);
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

}  // namespace

NpyArray parse_npy(const uint8_t* data, size_t size, const std::string& what) {
  static const uint8_t kMagic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  if (size < 10 || std::memcmp(data, kMagic, 6) != 0) fail(what, ": not a .npy file (bad magic)");
  const int major = data[6];
  size_t hlen, off;
  if (major == 1) {
    hlen = static_cast<size_t>(data[8]) | (static_cast<size_t>(data[9]) << 8);
    off = 10;
  } else if (major == 2 || major == 3) {
    if (size < 12) fail(what, ": truncated .npy header");
    hlen = static_cast<size_t>(data[8]) | (static_cast<size_t>(data[9]) << 8) |
           (static_cast<size_t>(data[10]) << 16) | (static_cast<size_t>(data[11]) << 24);
    off = 12;
  } else {
    fail(what, ": unsupported .npy version ", major);
  }
  if (hlen > size - off) fail(what, ": .npy header runs past the end of the file");
  const std::string h(reinterpret_cast<const char*>(data + off), hlen);
  NpyArray a;
  std::string descr = header_value(h, "descr", what);
  if (descr.size() >= 2) descr = descr.substr(1, descr.size() - 2);
  bool found = false;
  for (const auto& d : kDescrs)
    if (descr == d.text) {
      a.dtype = d.dtype;
      found = true;
    }
  if (!found)
    fail(what, ": unsupported npy dtype '", descr,
         "' (need little-endian f4/f8/f2/i8/i4/i1/u1/b1)");
  if (header_value(h, "fortran_order", what) != "False")
    fail(what, ": Fortran-order arrays are not supported");
  const std::string shape = header_value(h, "shape", what);
  size_t i = 1;
  while (i < shape.size()) {
    while (i < shape.size() && (shape[i] == ' ' || shape[i] == ',')) ++i;
    if (i >= shape.size() || shape[i] == ')') break;
    int64_t d = 0;
    if (shape[i] < '0' || shape[i] > '9') fail(what, ": bad npy shape ", shape);
    while (i < shape.size() && shape[i] >= '0' && shape[i] <= '9') {
      if (d > (std::numeric_limits<int64_t>::max() - 9) / 10) fail(what, ": npy shape overflows");
      d = d * 10 + (shape[i] - '0');
      ++i;
    }
    a.shape.push_back(d);
  }
  const size_t esize = dtype_size(a.dtype);
  size_t n = 1;
  for (int64_t d : a.shape) {
    if (d != 0 && n > std::numeric_limits<size_t>::max() / static_cast<size_t>(d) / esize)
      fail(what, ": npy shape too large");
    n *= static_cast<size_t>(d);
  }
  const size_t need = n * esize;
  if (need > size - off - hlen)
    fail(what, ": .npy data truncated: need ", need, " bytes, file has ", size - off - hlen);
  a.bytes.assign(data + off + hlen, data + off + hlen + need);
  return a;
}

NpyArray load_npy(const std::string& path) {
  MappedFile f(path);
  return parse_npy(f.data(), f.size(), path);
}

std::vector<float> NpyArray::to_f32() const {
  const size_t n = static_cast<size_t>(numel());
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* p = bytes.data() + i * dtype_size(dtype);
    switch (dtype) {
      case DType::F32:
        std::memcpy(&out[i], p, 4);
        break;
      case DType::F64: {
        double d;
        std::memcpy(&d, p, 8);
        out[i] = static_cast<float>(d);
        break;
      }
      case DType::F16: {
        uint16_t h;
        std::memcpy(&h, p, 2);
        out[i] = f16_to_f32(h);
        break;
      }
      case DType::I64: {
        int64_t v;
        std::memcpy(&v, p, 8);
        out[i] = static_cast<float>(v);
        break;
      }
      case DType::I32: {
        int32_t v;
        std::memcpy(&v, p, 4);
        out[i] = static_cast<float>(v);
        break;
      }
      case DType::I8:
        out[i] = static_cast<float>(static_cast<int8_t>(*p));
        break;
      case DType::U8:
      case DType::BOOL:
        out[i] = static_cast<float>(*p);
        break;
      default:
        fail("npy: cannot convert ", dtype_name(dtype), " to f32");
    }
  }
  return out;
}

std::vector<int64_t> NpyArray::to_i64() const {
  const size_t n = static_cast<size_t>(numel());
  std::vector<int64_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* p = bytes.data() + i * dtype_size(dtype);
    switch (dtype) {
      case DType::I64:
        std::memcpy(&out[i], p, 8);
        break;
      case DType::I32: {
        int32_t v;
        std::memcpy(&v, p, 4);
        out[i] = v;
        break;
      }
      case DType::I8:
        out[i] = static_cast<int8_t>(*p);
        break;
      case DType::U8:
      case DType::BOOL:
        out[i] = *p;
        break;
      default:
        fail("npy: expected an integer array, found ", dtype_name(dtype));
    }
  }
  return out;
}

void save_npy(const std::string& path, DType dtype, const Shape& shape, const void* data) {
  const char* descr = nullptr;
  for (const auto& d : kDescrs)
    if (d.dtype == dtype) descr = d.text;
  if (!descr) fail(path, ": cannot write dtype ", dtype_name(dtype), " to .npy");
  std::string sh = "(";
  for (size_t i = 0; i < shape.size(); ++i)
    sh += std::to_string(shape[i]) + (shape.size() == 1 ? "," : (i + 1 < shape.size() ? ", " : ""));
  sh += ")";
  std::string header =
      std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " + sh + ", }";
  const size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary);
  if (!out) fail(path, ": cannot open for writing");
  const uint8_t pre[10] = {0x93,
                           'N',
                           'U',
                           'M',
                           'P',
                           'Y',
                           1,
                           0,
                           static_cast<uint8_t>(header.size() & 0xff),
                           static_cast<uint8_t>(header.size() >> 8)};
  out.write(reinterpret_cast<const char*>(pre), 10);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(
      static_cast<const char*>(data),
      static_cast<std::streamsize>(shape_numel(shape) * static_cast<int64_t>(dtype_size(dtype))));
  if (!out) fail(path, ": write failed");
}

void save_npy_f32(const std::string& path, const Shape& shape, const std::vector<float>& v) {
  GEMSTAGE_CHECK(static_cast<int64_t>(v.size()) == shape_numel(shape), path,
                 ": size/shape mismatch");
  save_npy(path, DType::F32, shape, v.data());
}

void save_npy_i64(const std::string& path, const Shape& shape, const std::vector<int64_t>& v) {
  GEMSTAGE_CHECK(static_cast<int64_t>(v.size()) == shape_numel(shape), path,
                 ": size/shape mismatch");
  save_npy(path, DType::I64, shape, v.data());
}

namespace {
template <typename T>
std::vector<T> values_of(const NpyArray& a) {
  std::vector<T> v(static_cast<size_t>(a.numel()));
  if (!v.empty()) std::memcpy(v.data(), a.bytes.data(), v.size() * sizeof(T));
  return v;
}
}  // namespace

HostTensor npy_to_host_tensor(const NpyArray& a, const std::string& what) {
  switch (a.dtype) {
    case DType::F32:
      return HostTensor(a.shape, values_of<float>(a));
    case DType::I32:
      return HostTensor(a.shape, values_of<int32_t>(a));
    case DType::I64:
      return HostTensor(a.shape, values_of<int64_t>(a));
    case DType::U8:
      return HostTensor(a.shape, values_of<uint8_t>(a));
    default:
      fail(what, ": dtype ", dtype_name(a.dtype),
           " is not a stage tensor type; stage tensors are float32, int32, int64 or uint8");
  }
}

void save_npy(const std::string& path, const HostTensor& t) {
  switch (t.type()) {
    case ElemType::F32:
      return save_npy(path, DType::F32, t.shape(), t.values<float>().data());
    case ElemType::I32:
      return save_npy(path, DType::I32, t.shape(), t.values<int32_t>().data());
    case ElemType::I64:
      return save_npy(path, DType::I64, t.shape(), t.values<int64_t>().data());
    case ElemType::U8:
      return save_npy(path, DType::U8, t.shape(), t.values<uint8_t>().data());
  }
}

}  // namespace gemstage
