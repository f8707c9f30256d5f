#include "distributed/remote_stage_client.h"

#include <chrono>

#include "core/error.h"

namespace gemstage {

RemoteStageClient::RemoteStageClient(StageDecl decl, int rank,
                                     std::shared_ptr<StageTransport> transport,
                                     double decode_weight_bytes)
    : decl_(std::move(decl)),
      rank_(rank),
      transport_(std::move(transport)),
      decode_weight_bytes_(decode_weight_bytes) {}

std::string RemoteStageClient::failure() const {
  std::lock_guard<std::mutex> lk(mu_);
  return failure_;
}

RemoteStageStats RemoteStageClient::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

std::string RemoteStageClient::where() const {
  return "stage " + decl_.id + " on " + transport_->rank_name(rank_);
}

void RemoteStageClient::channel_failed(const Error& e) {
  // The channel is gone (the rank died, hung or the network failed): this stage and every
  // sequence on it are lost until the service restarts.
  std::lock_guard<std::mutex> lk(mu_);
  if (failure_.empty()) failure_ = where() + ": " + e.what();
  fail(failure_);
}

uint64_t RemoteStageClient::post(WireMessage m) {
  if (std::string f = failure(); !f.empty()) fail(f);
  m.stage = decl_.id;
  const bool want_reply = wire_op_has_reply(m.op);
  try {
    return transport_->post(rank_, encode_wire_message(m), want_reply);
  } catch (const Error& e) {
    channel_failed(e);
  }
}

WireMessage RemoteStageClient::receive(uint64_t ticket, WireOp op) {
  std::vector<uint8_t> reply;
  try {
    reply = transport_->take(ticket);
  } catch (const Error& e) {
    channel_failed(e);
  }
  WireMessage back = decode_wire_message(reply, where());
  if (back.op == WireOp::Failure) fail(back.error);
  if (back.op != WireOp::Result)
    fail(where(), ": answered ", wire_op_name(op), " with ", wire_op_name(back.op));
  return back;
}

WireMessage RemoteStageClient::call(WireMessage m) {
  const WireOp op = m.op;
  const uint64_t ticket = post(std::move(m));
  if (!wire_op_has_reply(op)) return {};
  return receive(ticket, op);
}

void RemoteStageClient::open_sequence(uint64_t sequence, int64_t max_context, KvType kv_type) {
  WireMessage m;
  m.op = WireOp::CreateSequence;
  m.sequences = {sequence};
  m.length = max_context;
  m.kv_type = kv_type;
  call(std::move(m));
}

void RemoteStageClient::close_sequence(uint64_t sequence) noexcept {
  try {
    WireMessage m;
    m.op = WireOp::FreeSequence;
    m.sequences = {sequence};
    call(std::move(m));
  } catch (const std::exception&) {
    // A rank that is gone holds nothing to free; its failure is already recorded.
  }
}

bool RemoteStageClient::can_truncate(uint64_t sequence, int64_t n) {
  WireMessage m;
  m.op = WireOp::CanTruncate;
  m.sequences = {sequence};
  m.length = n;
  return call(std::move(m)).length == 1;
}

void RemoteStageClient::truncate(uint64_t sequence, int64_t n) {
  WireMessage m;
  m.op = WireOp::Truncate;
  m.sequences = {sequence};
  m.length = n;
  call(std::move(m));
}

uint64_t RemoteStageClient::submit(TensorMap inputs, std::span<const uint64_t> sequences) {
  InFlight f;
  f.sent = std::chrono::steady_clock::now();
  WireMessage m;
  m.op = WireOp::Forward;
  m.sequences.assign(sequences.begin(), sequences.end());
  m.tensors = std::move(inputs);
  f.bytes = wire_tensor_bytes(m);
  const auto hidden = m.tensors.find("hidden_states");
  f.rows = hidden != m.tensors.end() && !hidden->second.shape().empty()
               ? static_cast<uint64_t>(hidden->second.shape()[0])
               : 0;
  const uint64_t ticket = post(std::move(m));
  std::lock_guard<std::mutex> lk(mu_);
  in_flight_[ticket] = f;
  return ticket;
}

bool RemoteStageClient::ready(uint64_t ticket) {
  try {
    return transport_->ready(ticket);
  } catch (const Error&) {
    return true;  // take() says why
  }
}

TensorMap RemoteStageClient::collect(uint64_t ticket) {
  InFlight f;
  {
    std::lock_guard<std::mutex> lk(mu_);
    const auto it = in_flight_.find(ticket);
    if (it == in_flight_.end()) fail(where(), ": no forward call in flight has ticket ", ticket);
    f = it->second;
    in_flight_.erase(it);
  }
  WireMessage back = receive(ticket, WireOp::Forward);
  check_wire_tensors(back, decl_, "output");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - f.sent).count();
  std::lock_guard<std::mutex> lk(mu_);
  stats_.calls += 1;
  stats_.rows += f.rows;
  stats_.bytes_sent += f.bytes;
  stats_.bytes_received += wire_tensor_bytes(back);
  stats_.round_trip_seconds += seconds;
  stats_.compute_seconds += static_cast<double>(back.length) * 1e-6;  // reported in microseconds
  return std::move(back.tensors);
}

void RemoteStageClient::commit(std::span<const uint64_t> sequences) {
  WireMessage m;
  m.op = WireOp::Commit;
  m.sequences.assign(sequences.begin(), sequences.end());
  call(std::move(m));
}

void RemoteStageClient::drop_uncommitted(std::span<const uint64_t> sequences) noexcept {
  try {
    WireMessage m;
    m.op = WireOp::Drop;
    m.sequences.assign(sequences.begin(), sequences.end());
    call(std::move(m));
  } catch (const std::exception&) {
  }
}

}  // namespace gemstage
