// The bytes that cross between ranks when a bundle's stages run in separate processes (issue 22).
// A message is one operation on one stage, addressed by stage id and sequence number, or its
// reply, and carries the stage contract's named tensors: name, element type, shape and row-major
// bytes. A forward call of several sequences carries their numbers in `sequences`, in the order
// the call's row_sequence tensor indexes them, so the worker runs the rows against its own
// per-sequence caches. Decoding bounds every length against the buffer before allocating, and
// decode_for_stage checks the tensors against the receiving stage's contract, so a peer's bad
// bytes are an error naming the field, never an out-of-bounds read.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cache/kv_cache.h"
#include "core/host_tensor.h"
#include "stage/contract.h"

namespace gemstage {

// Front (rank 0) to worker: CreateSequence .. Shutdown; worker to front: Result, Failure,
// Heartbeat. The front waits for a reply to CreateSequence, Forward, CanTruncate and Truncate
// only; the others are in order behind them on the same channel, so they need none.
enum class WireOp : uint8_t {
  CreateSequence = 1,  // length: max_context, kv_type
  Forward = 2,         // tensors: the stage's inputs
  FreeSequence = 3,
  Truncate = 4,  // keep the first `length` positions of the sequence
  Result = 5,    // tensors: the stage's outputs; for CanTruncate, length 1 (yes) or 0
  Failure = 6,   // `error` says what failed, naming the stage and host
  Commit = 7,    // keep the rows the last Forward appended for `sequences`
  Drop = 8,      // forget them (a later stage of the call failed)
  CanTruncate = 9,
  Shutdown = 10,   // the front is done; the worker leaves its loop
  Heartbeat = 11,  // the worker is still computing (sent while a call runs)
};
const char* wire_op_name(WireOp op);
// Whether the front waits for a reply to this op.
bool wire_op_has_reply(WireOp op);

struct WireMessage {
  WireOp op = WireOp::Forward;
  std::string stage;                // the stage id the operation is for
  std::vector<uint64_t> sequences;  // the sequence numbers it is for
  int64_t length = 0;               // CreateSequence: max_context; Truncate: positions kept
  KvType kv_type = KvType::F32;     // CreateSequence
  TensorMap tensors;                // Forward inputs / Result outputs
  std::string error;                // Failure
};

// Limits a decoder enforces before it allocates anything.
inline constexpr size_t kWireMaxNameBytes = 256;
inline constexpr size_t kWireMaxRank = 8;
inline constexpr size_t kWireMaxTensors = 1024;
inline constexpr size_t kWireMaxSequences = size_t{1} << 20;
inline constexpr size_t kWireMaxErrorBytes = size_t{1} << 16;
inline constexpr uint64_t kWireMaxTensorBytes = uint64_t{1} << 34;

std::vector<uint8_t> encode_wire_message(const WireMessage& m);
// Throws gemstage::Error naming `where` and the field that is malformed.
WireMessage decode_wire_message(std::span<const uint8_t> bytes, const std::string& where);

// Checks a Forward's (side "input") or Result's (side "output") tensors against the stage's
// contract (check_call_tensors): names, element types, ranks and dims.
void check_wire_tensors(const WireMessage& m, const StageDecl& stage, const char* side);
// decode_wire_message, then check_wire_tensors.
WireMessage decode_for_stage(std::span<const uint8_t> bytes, const StageDecl& stage,
                             const char* side, const std::string& where);

// Payload bytes of a message's tensors (what a hop costs per call, for the per-hop table).
uint64_t wire_tensor_bytes(const WireMessage& m);

}  // namespace gemstage
