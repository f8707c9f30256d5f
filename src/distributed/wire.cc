#include "distributed/wire.h"

#include <cstring>

#include "core/error.h"

namespace gemstage {
namespace {

constexpr char kMagic[4] = {'G', 'S', 'W', '1'};

size_t elem_size(ElemType t) {
  switch (t) {
    case ElemType::F32:
    case ElemType::I32:
      return 4;
    case ElemType::I64:
      return 8;
    case ElemType::U8:
      return 1;
  }
  return 0;
}

class Writer {
 public:
  void raw(const void* p, size_t n) {
    if (n == 0) return;
    const auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  }
  template <typename T>
  void put(T v) {
    raw(&v, sizeof v);
  }
  std::vector<uint8_t> out;
};

class Reader {
 public:
  Reader(std::span<const uint8_t> b, const std::string& where) : bytes_(b), where_(where) {}
  void raw(void* p, size_t n, const char* field) {
    if (n == 0) return;
    if (n > bytes_.size() - pos_)
      fail(where_, ": wire message truncated in ", field, " (needs ", n, " bytes at offset ", pos_,
           ", message has ", bytes_.size(), ")");
    std::memcpy(p, bytes_.data() + pos_, n);
    pos_ += n;
  }
  template <typename T>
  T get(const char* field) {
    T v{};
    raw(&v, sizeof v, field);
    return v;
  }
  size_t left() const { return bytes_.size() - pos_; }
  size_t pos() const { return pos_; }

 private:
  std::span<const uint8_t> bytes_;
  size_t pos_ = 0;
  const std::string& where_;
};

template <typename T>
HostTensor read_values(Reader& r, Shape shape, size_t n, const std::string& name) {
  std::vector<T> v(n);
  if (n > 0) r.raw(v.data(), n * sizeof(T), name.c_str());
  return HostTensor(std::move(shape), std::move(v));
}

}  // namespace

const char* wire_op_name(WireOp op) {
  switch (op) {
    case WireOp::CreateSequence:
      return "create";
    case WireOp::Forward:
      return "forward";
    case WireOp::FreeSequence:
      return "free";
    case WireOp::Truncate:
      return "truncate";
    case WireOp::Result:
      return "result";
    case WireOp::Failure:
      return "failure";
    case WireOp::Commit:
      return "commit";
    case WireOp::Drop:
      return "drop";
    case WireOp::CanTruncate:
      return "can-truncate";
    case WireOp::Shutdown:
      return "shutdown";
    case WireOp::Heartbeat:
      return "heartbeat";
  }
  return "?";
}

bool wire_op_has_reply(WireOp op) {
  return op == WireOp::CreateSequence || op == WireOp::Forward || op == WireOp::CanTruncate ||
         op == WireOp::Truncate;
}

std::vector<uint8_t> encode_wire_message(const WireMessage& m) {
  Writer w;
  w.raw(kMagic, 4);
  w.put<uint8_t>(static_cast<uint8_t>(m.op));
  w.put<uint16_t>(static_cast<uint16_t>(m.stage.size()));
  w.raw(m.stage.data(), m.stage.size());
  w.put<uint32_t>(static_cast<uint32_t>(m.sequences.size()));
  for (uint64_t s : m.sequences) w.put<uint64_t>(s);
  w.put<int64_t>(m.length);
  w.put<uint8_t>(static_cast<uint8_t>(m.kv_type));
  w.put<uint32_t>(static_cast<uint32_t>(m.error.size()));
  w.raw(m.error.data(), m.error.size());
  w.put<uint32_t>(static_cast<uint32_t>(m.tensors.size()));
  for (const auto& [name, t] : m.tensors) {
    w.put<uint16_t>(static_cast<uint16_t>(name.size()));
    w.raw(name.data(), name.size());
    w.put<uint8_t>(static_cast<uint8_t>(t.type()));
    w.put<uint8_t>(static_cast<uint8_t>(t.shape().size()));
    for (int64_t d : t.shape()) w.put<int64_t>(d);
    const uint64_t n = static_cast<uint64_t>(t.numel()) * elem_size(t.type());
    w.put<uint64_t>(n);
    switch (t.type()) {
      case ElemType::F32:
        w.raw(t.values<float>().data(), n);
        break;
      case ElemType::I32:
        w.raw(t.values<int32_t>().data(), n);
        break;
      case ElemType::I64:
        w.raw(t.values<int64_t>().data(), n);
        break;
      case ElemType::U8:
        w.raw(t.values<uint8_t>().data(), n);
        break;
    }
  }
  return std::move(w.out);
}

WireMessage decode_wire_message(std::span<const uint8_t> bytes, const std::string& where) {
  Reader r(bytes, where);
  char magic[4];
  r.raw(magic, 4, "magic");
  if (std::memcmp(magic, kMagic, 4) != 0)
    fail(where, ": not a gemstage wire message (bad magic; peer runs another version?)");
  WireMessage m;
  const auto op = r.get<uint8_t>("op");
  if (op < 1 || op > 11) fail(where, ": wire message op ", int(op), " unknown");
  m.op = static_cast<WireOp>(op);
  const auto stage_len = r.get<uint16_t>("stage id length");
  if (stage_len > kWireMaxNameBytes)
    fail(where, ": stage id length ", stage_len, " exceeds ", kWireMaxNameBytes);
  m.stage.resize(stage_len);
  r.raw(m.stage.data(), stage_len, "stage id");
  const auto n_seq = r.get<uint32_t>("sequence count");
  if (n_seq > kWireMaxSequences || uint64_t{n_seq} * 8 > r.left())
    fail(where, ": sequence count ", n_seq, " exceeds the message (", r.left(), " bytes left)");
  m.sequences.resize(n_seq);
  if (n_seq > 0) r.raw(m.sequences.data(), size_t{n_seq} * 8, "sequences");
  m.length = r.get<int64_t>("length");
  if (m.length < 0) fail(where, ": wire message length ", m.length, " is negative");
  const auto kv = r.get<uint8_t>("kv_type");
  if (kv != static_cast<uint8_t>(KvType::F32) && kv != static_cast<uint8_t>(KvType::BF16) &&
      kv != static_cast<uint8_t>(KvType::Q8_0))
    fail(where, ": kv_type code ", int(kv), " unknown");
  m.kv_type = static_cast<KvType>(kv);
  const auto error_len = r.get<uint32_t>("error length");
  if (error_len > kWireMaxErrorBytes || error_len > r.left())
    fail(where, ": error length ", error_len, " exceeds the message (", r.left(), " bytes left)");
  m.error.resize(error_len);
  r.raw(m.error.data(), error_len, "error");
  const auto count = r.get<uint32_t>("tensor count");
  if (count > kWireMaxTensors)
    fail(where, ": tensor count ", count, " exceeds the limit ", kWireMaxTensors);
  for (uint32_t i = 0; i < count; ++i) {
    const auto name_len = r.get<uint16_t>("tensor name length");
    if (name_len == 0 || name_len > kWireMaxNameBytes)
      fail(where, ": tensor ", i, " name length ", name_len, " outside 1..", kWireMaxNameBytes);
    std::string name(name_len, '\0');
    r.raw(name.data(), name_len, "tensor name");
    const auto type = r.get<uint8_t>("tensor dtype");
    if (type > static_cast<uint8_t>(ElemType::U8))
      fail(where, ": tensor ", name, " has unknown dtype code ", int(type));
    const auto rank = r.get<uint8_t>("tensor rank");
    if (rank > kWireMaxRank)
      fail(where, ": tensor ", name, " rank ", int(rank), " exceeds ", kWireMaxRank);
    Shape shape(rank);
    uint64_t numel = 1;
    for (auto& d : shape) {
      d = r.get<int64_t>("tensor dim");
      if (d < 0) fail(where, ": tensor ", name, " has negative dim ", d);
      if (d > 0 && numel > kWireMaxTensorBytes / static_cast<uint64_t>(d))
        fail(where, ": tensor ", name, " shape too large");
      numel *= static_cast<uint64_t>(d);
    }
    const auto et = static_cast<ElemType>(type);
    const uint64_t want = numel * elem_size(et);
    const auto given = r.get<uint64_t>("tensor byte count");
    if (given != want)
      fail(where, ": tensor ", name, " carries ", given, " bytes, its ", elem_type_name(et),
           " shape needs ", want);
    if (given > r.left())
      fail(where, ": tensor ", name, " needs ", given, " bytes, message has ", r.left(), " left");
    if (m.tensors.count(name)) fail(where, ": tensor ", name, " appears twice");
    const size_t n = static_cast<size_t>(numel);
    switch (et) {
      case ElemType::F32:
        m.tensors.emplace(name, read_values<float>(r, std::move(shape), n, name));
        break;
      case ElemType::I32:
        m.tensors.emplace(name, read_values<int32_t>(r, std::move(shape), n, name));
        break;
      case ElemType::I64:
        m.tensors.emplace(name, read_values<int64_t>(r, std::move(shape), n, name));
        break;
      case ElemType::U8:
        m.tensors.emplace(name, read_values<uint8_t>(r, std::move(shape), n, name));
        break;
    }
  }
  if (r.left() != 0) fail(where, ": ", r.left(), " trailing bytes after the wire message");
  return m;
}

void check_wire_tensors(const WireMessage& m, const StageDecl& stage, const char* side) {
  const bool input = std::strcmp(side, "input") == 0;
  DimBindings dims;
  check_call_tensors(stage, side, input ? stage.contract.inputs : stage.contract.outputs, m.tensors,
                     dims);
}

WireMessage decode_for_stage(std::span<const uint8_t> bytes, const StageDecl& stage,
                             const char* side, const std::string& where) {
  WireMessage m = decode_wire_message(bytes, where);
  check_wire_tensors(m, stage, side);
  return m;
}

uint64_t wire_tensor_bytes(const WireMessage& m) {
  uint64_t n = 0;
  for (const auto& [name, t] : m.tensors)
    n += static_cast<uint64_t>(t.numel()) * elem_size(t.type());
  return n;
}

}  // namespace gemstage
