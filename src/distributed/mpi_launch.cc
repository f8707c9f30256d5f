#include "distributed/mpi_launch.h"

#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "distributed/placement.h"
#include "distributed/remote_stage_client.h"
#include "distributed/stage_worker.h"
#include "distributed/wire.h"
#include "stage/bundle.h"
#include "stage/model.h"

namespace gemstage {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kTagRequest = 1, kTagReply = 2, kTagHandshake = 3, kTagHeartbeat = 4;
// MPI counts are ints: a message above this goes as a header then pieces of this size.
constexpr size_t kPieceBytes = size_t{1} << 30;
constexpr uint8_t kPiecedMarker = 'C';  // wire messages start with 'G' (distributed/wire.cc)
// How often a computing worker says it is alive; --stage-timeout must be well above it.
constexpr auto kHeartbeatInterval = std::chrono::milliseconds(250);
// How often rank 0 tells an idle worker it is still there. A worker that hears nothing from
// rank 0 for worker_silence_limit() leaves: with `mpirun --enable-recovery` a dead rank 0 would
// otherwise leave its workers (and so the job) running, and the supervisor would never restart it.
constexpr auto kKeepAliveInterval = std::chrono::seconds(1);
std::chrono::duration<double> worker_silence_limit(double stage_timeout_seconds) {
  return std::chrono::duration<double>(std::max(10.0, 2 * stage_timeout_seconds));
}

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  fail(what, " failed: ", std::string(text, static_cast<size_t>(len)));
}

std::string host_name() {
  char name[MPI_MAX_PROCESSOR_NAME];
  int len = 0;
  if (MPI_Get_processor_name(name, &len) == MPI_SUCCESS && len > 0)
    return std::string(name, static_cast<size_t>(len));
  return "?";
}

// Waits without burning a core the compute threads need: a short spin for the low latency of a
// decode hop, then sleeps growing to `cap`.
class Backoff {
 public:
  explicit Backoff(std::chrono::microseconds cap) : cap_(cap) {}
  void pause() {
    if (++spins_ < 200) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(cap_, sleep_ * 2);
  }
  void reset() {
    spins_ = 0;
    sleep_ = std::chrono::microseconds(20);
  }

 private:
  std::chrono::microseconds cap_;
  std::chrono::microseconds sleep_{20};
  int spins_ = 0;
};

// Probes for a message from `src` with `tag` until `deadline` (none: wait for ever).
bool probe_until(int src, int tag, std::optional<Clock::time_point> deadline, MPI_Status* st,
                 std::chrono::microseconds cap) {
  Backoff b(cap);
  for (;;) {
    int flag = 0;
    check_mpi(MPI_Iprobe(src, tag, MPI_COMM_WORLD, &flag, st), "MPI_Iprobe");
    if (flag) return true;
    if (deadline && Clock::now() > *deadline) return false;
    b.pause();
  }
}

// Receives the message `st` announced (and its pieces, if it was split).
std::vector<uint8_t> receive_bytes(const MPI_Status& st, std::optional<Clock::time_point> deadline,
                                   std::chrono::microseconds cap) {
  int count = 0;
  check_mpi(MPI_Get_count(&st, MPI_BYTE, &count), "MPI_Get_count");
  std::vector<uint8_t> bytes(static_cast<size_t>(count));
  check_mpi(MPI_Recv(bytes.data(), count, MPI_BYTE, st.MPI_SOURCE, st.MPI_TAG, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE),
            "MPI_Recv");
  if (count != 9 || bytes[0] != kPiecedMarker) return bytes;
  uint64_t total = 0;
  std::memcpy(&total, bytes.data() + 1, 8);
  if (total > kWireMaxTensorBytes * 4) fail("a message of ", total, " bytes exceeds the limit");
  std::vector<uint8_t> whole;
  whole.reserve(static_cast<size_t>(total));
  while (whole.size() < total) {
    MPI_Status piece;
    if (!probe_until(st.MPI_SOURCE, st.MPI_TAG, deadline, &piece, cap))
      fail("a split message stopped arriving");
    int n = 0;
    check_mpi(MPI_Get_count(&piece, MPI_BYTE, &n), "MPI_Get_count");
    if (static_cast<uint64_t>(n) > total - whole.size()) fail("a split message overran its size");
    const size_t at = whole.size();
    whole.resize(at + static_cast<size_t>(n));
    check_mpi(MPI_Recv(whole.data() + at, n, MPI_BYTE, st.MPI_SOURCE, st.MPI_TAG, MPI_COMM_WORLD,
                       MPI_STATUS_IGNORE),
              "MPI_Recv");
  }
  return whole;
}

std::string broadcast_string(std::string s, int root) {
  uint64_t n = s.size();
  check_mpi(MPI_Bcast(&n, 1, MPI_UINT64_T, root, MPI_COMM_WORLD), "MPI_Bcast");
  if (n > (uint64_t{1} << 24)) fail("start-up message of ", n, " bytes");
  s.resize(static_cast<size_t>(n));
  check_mpi(MPI_Bcast(s.data(), static_cast<int>(n), MPI_CHAR, root, MPI_COMM_WORLD), "MPI_Bcast");
  return s;
}

// A message on its way out, in pieces when it exceeds what one MPI count holds, progressed
// between the sender's other duties (taking in what arrives meanwhile). The bytes must outlive it.
class OutgoingMessage {
 public:
  OutgoingMessage(std::span<const uint8_t> bytes, int dest, int tag)
      : bytes_(bytes), dest_(dest), tag_(tag) {
    if (bytes_.size() <= kPieceBytes) {
      pieces_.push_back({bytes_.data(), bytes_.size()});
      return;
    }
    header_[0] = kPiecedMarker;
    const uint64_t total = bytes_.size();
    std::memcpy(header_ + 1, &total, 8);
    pieces_.push_back({header_, sizeof header_});
    for (size_t at = 0; at < bytes_.size(); at += kPieceBytes)
      pieces_.push_back({bytes_.data() + at, std::min(kPieceBytes, bytes_.size() - at)});
  }
  OutgoingMessage(const OutgoingMessage&) = delete;
  OutgoingMessage& operator=(const OutgoingMessage&) = delete;
  // Gives up on a send that cannot leave (a dead peer never takes it).
  ~OutgoingMessage() {
    if (active_) MPI_Request_free(&req_);
  }

  // Moves the send on; true once every piece left.
  bool progress() {
    for (;;) {
      if (active_) {
        int done = 0;
        check_mpi(MPI_Test(&req_, &done, MPI_STATUS_IGNORE), "MPI_Test");
        if (!done) return false;
        active_ = false;
        ++next_;
      }
      if (next_ == pieces_.size()) return true;
      const auto [data, n] = pieces_[next_];
      check_mpi(MPI_Isend(data, static_cast<int>(n), MPI_BYTE, dest_, tag_, MPI_COMM_WORLD, &req_),
                "MPI_Isend");
      active_ = true;
    }
  }

 private:
  std::span<const uint8_t> bytes_;
  uint8_t header_[9] = {};
  std::vector<std::pair<const void*, size_t>> pieces_;
  int dest_, tag_;
  size_t next_ = 0;
  bool active_ = false;
  MPI_Request req_ = MPI_REQUEST_NULL;
};

// Sends `bytes`, waiting at most until `deadline` for it to leave (a dead peer never takes it);
// `meanwhile` runs while it waits (true: it had something to do, so the wait spins on).
void send_within(std::span<const uint8_t> bytes, int dest, int tag, Clock::time_point deadline,
                 const std::function<bool()>& meanwhile = {}) {
  OutgoingMessage out(bytes, dest, tag);
  Backoff b(std::chrono::microseconds(200));
  while (!out.progress()) {
    if (Clock::now() > deadline) fail("could not send to it within the stage timeout");
    if (meanwhile && meanwhile())
      b.reset();
    else
      b.pause();
  }
}

// Rank 0's channels to the workers. Every wait here also takes in whatever the workers sent
// (replies, heartbeats): a worker may be sending its reply to one call while rank 0 sends it the
// next, and neither send can finish until the other side receives.
class MpiTransport final : public StageTransport {
 public:
  MpiTransport(std::vector<std::string> hosts, double timeout_seconds)
      : hosts_(std::move(hosts)),
        timeout_(std::chrono::duration_cast<Clock::duration>(
            std::chrono::duration<double>(timeout_seconds))),
        ranks_(hosts_.size()) {
    // While the engine computes its own stages (or sits idle) nothing else sends.
    keeper_ = std::thread([this] {
      std::unique_lock<std::mutex> lk(mu_);
      while (!keeper_stop_) {
        keep_alive();
        keeper_cv_.wait_for(lk, kKeepAliveInterval / 2);
      }
    });
  }
  ~MpiTransport() override { stop_keeper(); }

  std::string rank_name(int rank) const override {
    return "rank " + std::to_string(rank) + " (host " + hosts_.at(static_cast<size_t>(rank)) + ")";
  }

  uint64_t post(int rank, const std::vector<uint8_t>& request, bool want_reply) override {
    std::lock_guard<std::mutex> lk(mu_);
    RankState& r = ranks_.at(static_cast<size_t>(rank));
    if (!r.failed.empty()) fail(r.failed);
    // The call waits for its reply before its first byte leaves. While the send progresses this
    // thread takes in what the workers send, and the worker can receive, compute and answer
    // before MPI reports the send complete; a reply must then find its call at the front of
    // `waiting`, not be dropped (its call would time out and the next call on the rank would
    // take this one's reply).
    uint64_t ticket = 0;
    if (want_reply) {
      // An idle rank starts its clock now; a busy one keeps the clock of its running call.
      if (r.waiting.empty()) r.heard = Clock::now();
      ticket = ++last_ticket_;
      r.waiting.push_back(ticket);
      rank_of_[ticket] = rank;
    }
    try {
      send_taking_in(request, rank);
      r.sent = Clock::now();
    } catch (const Error& e) {
      mark_failed(rank, e.what());
      if (ticket != 0) rank_of_.erase(ticket);  // the caller gets no ticket to take
      throw;
    }
    return ticket;
  }

  bool ready(uint64_t ticket) override {
    std::lock_guard<std::mutex> lk(mu_);
    const int rank = rank_of(ticket);
    if (replies_.count(ticket)) return true;
    take_in();
    check_clock(rank);
    return replies_.count(ticket) > 0 || !ranks_[static_cast<size_t>(rank)].failed.empty();
  }

  std::vector<uint8_t> take(uint64_t ticket) override {
    std::lock_guard<std::mutex> lk(mu_);
    const int rank = rank_of(ticket);
    Backoff b(std::chrono::microseconds(200));
    for (;;) {
      if (const auto it = replies_.find(ticket); it != replies_.end()) {
        std::vector<uint8_t> bytes = std::move(it->second);
        replies_.erase(it);
        rank_of_.erase(ticket);
        return bytes;
      }
      const std::string& failed = ranks_[static_cast<size_t>(rank)].failed;
      if (!failed.empty()) {
        rank_of_.erase(ticket);
        fail(failed);
      }
      if (take_in())
        b.reset();
      else
        b.pause();
      check_clock(rank);
      keep_alive();
    }
  }

  bool any_failed() const {
    std::lock_guard<std::mutex> lk(mu_);
    return any_failed_;
  }
  // Tells every worker still answering to leave its loop.
  void shut_down() {
    stop_keeper();
    std::lock_guard<std::mutex> lk(mu_);
    WireMessage m;
    m.op = WireOp::Shutdown;
    const auto bytes = encode_wire_message(m);
    for (size_t r = 1; r < hosts_.size(); ++r) {
      if (!ranks_[r].failed.empty()) continue;
      try {
        send_taking_in(bytes, static_cast<int>(r));
      } catch (const Error& e) {
        mark_failed(static_cast<int>(r), e.what());
      }
    }
  }

 private:
  struct RankState {
    std::deque<uint64_t> waiting;  // tickets sent, in order, whose reply has not come
    Clock::time_point heard;       // the last sign of life while it had calls
    Clock::time_point sent;        // the last message to it
    std::string failed;
  };

  void stop_keeper() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      keeper_stop_ = true;
    }
    keeper_cv_.notify_all();
    if (keeper_.joinable()) keeper_.join();
  }

  // Under mu_: an empty message to each live worker not sent anything for a while. It never
  // waits (an empty message leaves at once; a dead peer's failure shows in its calls).
  void keep_alive() {
    if (keeper_stop_) return;  // shutting down: the workers are leaving
    const auto now = Clock::now();
    for (size_t r = 1; r < ranks_.size(); ++r) {
      RankState& st = ranks_[r];
      if (!st.failed.empty() || now - st.sent < kKeepAliveInterval) continue;
      MPI_Request req;
      if (MPI_Isend(nullptr, 0, MPI_BYTE, static_cast<int>(r), kTagHeartbeat, MPI_COMM_WORLD,
                    &req) == MPI_SUCCESS)
        MPI_Request_free(&req);
      st.sent = now;
    }
  }

  int rank_of(uint64_t ticket) const {
    const auto it = rank_of_.find(ticket);
    if (it == rank_of_.end()) fail("stage transport: no call in flight has ticket ", ticket);
    return it->second;
  }

  void mark_failed(int rank, const std::string& why) {
    RankState& r = ranks_[static_cast<size_t>(rank)];
    if (r.failed.empty()) r.failed = why;
    any_failed_ = true;
  }

  // A rank with calls in flight that said nothing for the timeout is dead, hung or unreachable.
  void check_clock(int rank) {
    RankState& r = ranks_[static_cast<size_t>(rank)];
    if (r.failed.empty() && !r.waiting.empty() && Clock::now() - r.heard > timeout_)
      mark_failed(rank, "no answer within " +
                            std::to_string(std::chrono::duration<double>(timeout_).count()) +
                            " s (the rank died, hangs, or its host is unreachable); restart the "
                            "service");
  }

  // Receives every message the workers have sent; true if there was any.
  bool take_in() {
    bool any = false;
    for (;;) {
      MPI_Status st;
      int flag = 0;
      check_mpi(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &flag, &st), "MPI_Iprobe");
      if (!flag) return any;
      any = true;
      const int src = st.MPI_SOURCE;
      if (src <= 0 || static_cast<size_t>(src) >= ranks_.size() ||
          (st.MPI_TAG != kTagReply && st.MPI_TAG != kTagHeartbeat)) {
        receive_bytes(st, Clock::now() + timeout_, std::chrono::microseconds(200));
        continue;  // not a channel message (cannot happen with our workers); drop it
      }
      RankState& r = ranks_[static_cast<size_t>(src)];
      try {
        std::vector<uint8_t> bytes =
            receive_bytes(st, Clock::now() + timeout_, std::chrono::microseconds(200));
        r.heard = Clock::now();
        if (st.MPI_TAG == kTagReply) {
          // Every reply answers the oldest call waiting on its rank; one with no call waiting
          // means the two sides no longer agree which reply is whose, so nothing more from
          // the rank can be trusted.
          if (r.waiting.empty())
            fail("it sent a reply when no call to it was waiting; restart the service");
          replies_[r.waiting.front()] = std::move(bytes);
          r.waiting.pop_front();
        }
      } catch (const Error& e) {
        mark_failed(src, e.what());
      }
    }
  }

  // Sends, taking in what arrives meanwhile, waiting at most the timeout for the send to leave.
  void send_taking_in(const std::vector<uint8_t>& bytes, int dest) {
    send_within(bytes, dest, kTagRequest, Clock::now() + timeout_, [this] {
      const bool any = take_in();
      keep_alive();
      return any;
    });
  }

  std::vector<std::string> hosts_;
  Clock::duration timeout_;
  mutable std::mutex mu_;
  std::vector<RankState> ranks_;
  std::map<uint64_t, int> rank_of_;                   // tickets not yet taken
  std::map<uint64_t, std::vector<uint8_t>> replies_;  // replies in, not yet taken
  uint64_t last_ticket_ = 0;
  bool any_failed_ = false;
  std::condition_variable keeper_cv_;
  bool keeper_stop_ = false;
  std::thread keeper_;  // last: it uses everything above
};

}  // namespace

struct DistributedSession::Impl {
  int rank = 0, ranks = 1;
  DistributedOptions options;
  std::shared_ptr<MpiTransport> transport;  // rank 0
  std::shared_ptr<const Model> model;       // a worker's own stages
  ModelOpener models;                       // rank 0: the bundle with the job's placement
  std::string where;
  bool finalized = false;

  void finalize() {
    if (!finalized) MPI_Finalize();
    finalized = true;
  }
};

DistributedSession::DistributedSession(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

int DistributedSession::rank() const {
  return impl_->rank;
}
int DistributedSession::ranks() const {
  return impl_->ranks;
}
const ModelOpener& DistributedSession::models() const {
  return impl_->models;
}

std::unique_ptr<DistributedSession> DistributedSession::start(const DistributedOptions& o) {
  int provided = 0;
  check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  auto impl = std::make_unique<Impl>();
  impl->options = o;
  MPI_Comm_rank(MPI_COMM_WORLD, &impl->rank);
  MPI_Comm_size(MPI_COMM_WORLD, &impl->ranks);
  const int rank = impl->rank, ranks = impl->ranks;
  const std::string host = host_name();
  impl->where = "rank " + std::to_string(rank) + " (host " + host + ")";
  std::unique_ptr<DistributedSession> session(new DistributedSession(std::move(impl)));
  Impl& s = *session->impl_;
  if (provided < MPI_THREAD_SERIALIZED) {
    s.finalize();
    fail("this MPI library gives thread level ", provided,
         "; gemstage needs MPI_THREAD_SERIALIZED (its server calls MPI from several threads)");
  }
  const auto handshake_deadline = Clock::now() + std::chrono::minutes(10);

  // 1. Rank 0 places the stages and tells everyone (or tells them why it cannot).
  std::string plan;
  Placement placement;
  std::string manifest_sha;
  if (rank == 0) {
    try {
      if (!is_bundle_dir(o.bundle))
        fail(o.bundle,
             ": `mpirun` runs a bundle's stages on ranks; export one first "
             "(gemstage export -m CHECKPOINT -o BUNDLE --stages N)");
      const BundleManifest bm = read_bundle_manifest(o.bundle);
      std::vector<std::string> ids;
      std::vector<bool> tf;
      std::string embeddings_id;
      for (const BundleStage& st : bm.stages) {
        ids.push_back(st.decl.id);
        tf.push_back(st.decl.role == StageRole::TransformerLayers);
        if (st.decl.role == StageRole::Embeddings) embeddings_id = st.decl.id;
      }
      placement = o.placement.empty() ? default_placement(ids, tf, ranks)
                                      : parse_placement(o.placement, ids, ranks);
      check_front_placement(placement, embeddings_id);
      plan = "ok\n" + placement_spec(placement);
    } catch (const Error& e) {
      plan = std::string("error\n") + e.what();
    }
  }
  plan = broadcast_string(plan, 0);
  const std::string verdict_word = plan.substr(0, plan.find('\n'));
  const std::string body = plan.substr(plan.find('\n') + 1);
  if (verdict_word != "ok") {
    s.finalize();
    fail(rank == 0 ? body : "rank 0 stopped the start: " + body);
  }

  // 2. Every worker opens its own stages and says who it is.
  RankIdentity me;
  me.rank = rank;
  me.host = host;
  try {
    manifest_sha = sha256_file(o.bundle + "/manifest.json");
    me.manifest_sha256 = manifest_sha;
    if (rank != 0) {
      const BundleManifest bm = read_bundle_manifest(o.bundle);
      std::vector<std::string> ids;
      for (const BundleStage& st : bm.stages) ids.push_back(st.decl.id);
      std::set<std::string> mine;
      for (const auto& [r, list] : parse_placement(body, ids, ranks))
        if (r == rank) mine.insert(list.begin(), list.end());
      s.model = Model::open(o.bundle, StagePlacementOptions{mine, nullptr});
      for (const auto& st : s.model->stages())
        if (st) {
          me.stages_held.push_back(st->id());
          me.decode_weight_bytes[st->id()] = st->decode_weight_bytes();
        }
    }
  } catch (const std::exception& e) {
    me.error = e.what();
  }
  // 3. Rank 0 checks everyone and says whether the job goes on.
  std::string verdict;
  std::vector<RankIdentity> identities;
  if (rank != 0) {
    const std::string bytes = encode_rank_identity(me);
    send_within(std::span(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), 0,
                kTagHandshake, handshake_deadline);
  } else {
    try {
      if (!me.error.empty()) fail("rank 0 (host ", host, "): ", me.error);
      me.stages_held = placement.at(0);
      identities.push_back(me);
      for (int r = 1; r < ranks; ++r) {
        MPI_Status st;
        if (!probe_until(r, kTagHandshake, handshake_deadline, &st, std::chrono::milliseconds(5)))
          fail("handshake: rank ", r, " did not report within 10 minutes");
        const auto bytes = receive_bytes(st, handshake_deadline, std::chrono::milliseconds(5));
        identities.push_back(decode_rank_identity(std::string(bytes.begin(), bytes.end()),
                                                  "handshake: rank " + std::to_string(r)));
        if (identities.back().rank != r)
          fail("handshake: rank ", r, " says it is rank ", identities.back().rank);
      }
      check_handshake(manifest_sha, placement, identities);
    } catch (const Error& e) {
      verdict = e.what();
    }
  }
  verdict = broadcast_string(verdict, 0);
  if (!verdict.empty()) {
    s.finalize();
    fail(rank == 0 ? verdict : "rank 0 refused the start: " + verdict);
  }

  // 4. Rank 0 opens the command's model with the other ranks' stages as remote clients.
  if (rank == 0) {
    std::vector<std::string> hosts;
    for (const auto& id : identities) hosts.push_back(id.host);
    s.transport = std::make_shared<MpiTransport>(hosts, o.stage_timeout_seconds);
    std::map<std::string, int> rank_of;
    for (const auto& [r, list] : placement)
      for (const auto& id : list) rank_of[id] = r;
    StagePlacementOptions local;
    local.local.insert(placement.at(0).begin(), placement.at(0).end());
    local.remote = [transport = s.transport, rank_of,
                    identities](const StageDecl& d) -> std::unique_ptr<RemoteStage> {
      const int r = rank_of.at(d.id);
      const auto& bytes = identities.at(static_cast<size_t>(r)).decode_weight_bytes;
      const auto it = bytes.find(d.id);
      return std::make_unique<RemoteStageClient>(d, r, transport,
                                                 it == bytes.end() ? 0.0 : it->second);
    };
    s.models = ModelOpener(o.bundle, std::move(local));
    std::cerr << "gemstage: " << ranks << " ranks; " << placement_spec(placement) << "\n";
  }
  return session;
}

DistributedSession::~DistributedSession() {
  Impl& s = *impl_;
  if (s.rank == 0 && s.transport && !s.finalized) {
    s.transport->shut_down();
    if (s.transport->any_failed()) {
      // A dead or hung rank cannot take part in MPI_Finalize; end the whole job instead.
      std::cerr << "gemstage: a rank stopped answering; aborting the MPI job" << std::endl;
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
  s.finalize();
}

// The worker's two threads: calls run one after another, in the order they came, on a compute
// thread, while this thread keeps the channel - it takes the next requests as they arrive (so
// rank 0 hands over the next micro-batch while this one computes, and its send never waits on
// ours), sends the replies, and says the rank is alive while calls compute. Only this thread
// calls MPI.
int DistributedSession::run_worker() {
  Impl& s = *impl_;
  ThreadPool pool(s.options.threads > 0 ? s.options.threads : default_thread_count());
  StageWorker worker(s.model, pool, s.where);
  struct Work {
    WireMessage message;
    std::string error;  // the request could not be read: answer with this Failure
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Work> inbox;
  std::deque<WireMessage> outbox;
  bool stopping = false, computing = false;
  auto failure = [&](const std::string& why) {
    WireMessage f;
    f.op = WireOp::Failure;
    f.error = s.where + ": " + why;
    return f;
  };
  std::thread compute([&] {
    for (;;) {
      Work w;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return stopping || !inbox.empty(); });
        if (stopping) return;
        w = std::move(inbox.front());
        inbox.pop_front();
        computing = true;
      }
      std::optional<WireMessage> reply;
      if (!w.error.empty()) {
        reply = failure(w.error);
      } else {
        try {
          reply = worker.handle(w.message);
        } catch (const std::exception& e) {
          reply = failure(e.what());
        }
      }
      std::lock_guard<std::mutex> lk(mu);
      computing = false;
      if (reply) outbox.push_back(std::move(*reply));
    }
  });

  const auto never = std::optional<Clock::time_point>{};
  std::vector<uint8_t> sending_bytes;
  std::optional<OutgoingMessage> sending;
  auto last_beat = Clock::now(), heard = Clock::now();
  const auto silence_limit = worker_silence_limit(s.options.stage_timeout_seconds);
  Backoff b(std::chrono::microseconds(200));
  for (bool stop = false; !stop;) {
    bool any = false;
    MPI_Status st;
    int flag = 0;
    check_mpi(MPI_Iprobe(0, MPI_ANY_TAG, MPI_COMM_WORLD, &flag, &st), "MPI_Iprobe");
    if (flag) heard = Clock::now();
    if (flag && st.MPI_TAG != kTagRequest) {
      // Rank 0's keep-alive (or nothing a worker reads).
      any = true;
      receive_bytes(st, never, std::chrono::microseconds(200));
    } else if (flag) {
      any = true;
      Work w;
      try {
        const auto bytes = receive_bytes(st, never, std::chrono::microseconds(200));
        w.message = decode_wire_message(bytes, s.where + ": message from rank 0");
      } catch (const std::exception& e) {
        w.error = e.what();
      }
      if (w.error.empty() && w.message.op == WireOp::Shutdown) {
        stop = true;
      } else {
        std::lock_guard<std::mutex> lk(mu);
        inbox.push_back(std::move(w));
      }
      cv.notify_one();
    }
    if (sending && sending->progress()) {
      sending.reset();
      any = true;
    }
    bool busy = false;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (!sending && !outbox.empty()) {
        sending_bytes = encode_wire_message(outbox.front());
        sending.emplace(sending_bytes, 0, kTagReply);
        outbox.pop_front();
        any = true;
      }
      busy = computing || !inbox.empty();
    }
    if (sending && sending->progress()) sending.reset();
    if (busy && Clock::now() - last_beat >= kHeartbeatInterval) {
      check_mpi(MPI_Send(nullptr, 0, MPI_BYTE, 0, kTagHeartbeat, MPI_COMM_WORLD), "MPI_Send");
      last_beat = Clock::now();
    }
    if (!busy) last_beat = Clock::now();  // rank 0 starts the clock of a call when it sends it
    if (Clock::now() - heard > silence_limit) {
      std::cerr << "gemstage: " << s.where << ": rank 0 sent nothing for " << silence_limit.count()
                << " s (it died or its host is unreachable); this worker leaves the job\n";
      std::_Exit(1);  // MPI cannot finalize without rank 0
    }
    if (any)
      b.reset();
    else
      b.pause();
  }
  {
    std::lock_guard<std::mutex> lk(mu);
    stopping = true;
    inbox.clear();
  }
  cv.notify_all();
  compute.join();
  return 0;
}

}  // namespace gemstage
