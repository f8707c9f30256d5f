// The bytes that cross between ranks when a bundle's stages run in separate processes (issue 22).
// A message is one sequence operation addressed by sequence id (create / forward rows / free /
// roll back) or its reply, and carries the stage contract's named tensors: name, element type,
// shape and row-major bytes. Batched calls carry row_sequence (which sequence each row belongs
// to) so a worker can split a forward_batch's rows back onto its own per-sequence caches.
// Decoding bounds every length against the buffer before allocating, and decode_for_stage checks
// the tensors against the receiving stage's contract, so a peer's bad bytes are an error naming
// the field, never an out-of-bounds read.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/host_tensor.h"
#include "stage/contract.h"

namespace gemstage {

enum class WireOp : uint8_t {
  CreateSequence = 1,
  Forward = 2,
  FreeSequence = 3,
  RollBack = 4,  // keep the first `length` positions of the sequence
  Result = 5,
  Failure = 6,  // `error` says what failed, naming the stage and host
};
const char* wire_op_name(WireOp op);

struct WireMessage {
  WireOp op = WireOp::Forward;
  uint64_t sequence_id = 0;
  int64_t length = 0;                  // RollBack: positions kept
  std::vector<uint64_t> row_sequence;  // Forward of a batch: the sequence id of each row
  TensorMap tensors;                   // Forward inputs / Result outputs
  std::string error;                   // Failure
};

// Limits a decoder enforces before it allocates anything.
inline constexpr size_t kWireMaxNameBytes = 256;
inline constexpr size_t kWireMaxRank = 8;
inline constexpr size_t kWireMaxTensors = 1024;
inline constexpr uint64_t kWireMaxTensorBytes = uint64_t{1} << 34;

std::vector<uint8_t> encode_wire_message(const WireMessage& m);
// Throws gemstage::Error naming `where` and the field that is malformed.
WireMessage decode_wire_message(std::span<const uint8_t> bytes, const std::string& where);

// Decodes a Forward (side "input") or Result (side "output") message and checks its tensors
// against the stage's contract (check_call_tensors): names, element types, ranks and dims.
WireMessage decode_for_stage(std::span<const uint8_t> bytes, const StageDecl& stage,
                             const char* side, const std::string& where);

// Payload bytes of a message's tensors (what a hop costs per call, for the per-hop table).
uint64_t wire_tensor_bytes(const WireMessage& m);

}  // namespace gemstage
