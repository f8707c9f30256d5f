// The stage wire format, placement and handshake of issue 22 (no MPI needed).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "core/error.h"
#include "core/thread_pool.h"
#include "distributed/placement.h"
#include "distributed/remote_stage_client.h"
#include "distributed/stage_worker.h"
#include "distributed/wire.h"
#include "gemma4/config.h"
#include "runtime/engine.h"
#include "stage/bundle.h"
#include "stage/call_pipeline.h"
#include "stage/sequence.h"
#include "test_util.h"

namespace gemstage {
namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// A transformer stage of the tiny fixture and a call's inputs built from its own contract,
// every symbolic dim bound to 3 and every value distinct, so a round trip that moved, dropped or
// reordered a byte shows.
struct StageCall {
  StageDecl stage;
  TensorMap inputs;
};

StageCall layers_call() {
  const ModelConfig c = load_model_config(testing::fixture("model"));
  StageCall call;
  call.stage.id = "layers_0_3";
  call.stage.role = StageRole::TransformerLayers;
  call.stage.layers = {0, 3};
  call.stage.contract = contract_for(call.stage.role, call.stage.layers, c);
  int counter = 1;
  for (const auto& d : call.stage.contract.inputs) {
    if (d.optional) continue;
    Shape shape;
    for (const auto& dim : d.shape)
      shape.push_back(std::isdigit(static_cast<unsigned char>(dim[0])) ? std::stoll(dim) : 3);
    const auto n = static_cast<size_t>(shape_numel(shape));
    if (d.dtype == "f32") {
      std::vector<float> v(n);
      for (auto& x : v) x = 0.001f * static_cast<float>(counter++) - 0.5f;
      call.inputs.emplace(d.name, HostTensor(shape, std::move(v)));
    } else if (d.dtype == "i32") {
      std::vector<int32_t> v(n);
      for (auto& x : v) x = counter++;
      call.inputs.emplace(d.name, HostTensor(shape, std::move(v)));
    } else if (d.dtype == "i64") {
      std::vector<int64_t> v(n);
      for (auto& x : v) x = counter++;
      call.inputs.emplace(d.name, HostTensor(shape, std::move(v)));
    } else {
      std::vector<uint8_t> v(n);
      for (auto& x : v) x = static_cast<uint8_t>(counter++);
      call.inputs.emplace(d.name, HostTensor(shape, std::move(v)));
    }
  }
  return call;
}

TEST(Wire, ForwardRoundTripsBitExactAndPassesTheReceivingContract) {
  const StageCall call = layers_call();
  ASSERT_FALSE(call.inputs.empty());
  WireMessage m;
  m.op = WireOp::Forward;
  m.stage = "layers_0_3";
  m.sequences = {7, 9};
  m.tensors = call.inputs;
  const auto bytes = encode_wire_message(m);
  const WireMessage back = decode_for_stage(bytes, call.stage, "input", "rank 1");
  EXPECT_EQ(back.op, WireOp::Forward);
  EXPECT_EQ(back.stage, "layers_0_3");
  EXPECT_EQ(back.sequences, (std::vector<uint64_t>{7, 9}));
  ASSERT_EQ(back.tensors.size(), call.inputs.size());
  for (const auto& [name, t] : call.inputs) {
    const HostTensor& u = back.tensors.at(name);
    EXPECT_EQ(u.type(), t.type()) << name;
    EXPECT_EQ(u.shape(), t.shape()) << name;
    if (t.type() == ElemType::F32) {
      ASSERT_EQ(u.values<float>().size(), t.values<float>().size());
      EXPECT_EQ(0, std::memcmp(u.values<float>().data(), t.values<float>().data(),
                               t.values<float>().size_bytes()))
          << name;
    }
  }
  EXPECT_GT(wire_tensor_bytes(m), 0u);
}

TEST(Wire, ReceivingContractRejectsAMissingTensorAndAWrongDtype) {
  const StageCall call = layers_call();
  WireMessage m;
  m.tensors = call.inputs;
  const std::string dropped = m.tensors.begin()->first;
  m.tensors.erase(m.tensors.begin());
  std::string msg =
      error_of([&] { decode_for_stage(encode_wire_message(m), call.stage, "input", "rank 1"); });
  EXPECT_NE(msg.find(dropped), std::string::npos) << msg;
  EXPECT_NE(msg.find("layers_0_3"), std::string::npos) << msg;

  m.tensors = call.inputs;
  auto& first = m.tensors.begin()->second;
  first = HostTensor(first.shape(), std::vector<uint8_t>(static_cast<size_t>(first.numel())));
  if (call.inputs.begin()->second.type() != ElemType::U8) {
    msg =
        error_of([&] { decode_for_stage(encode_wire_message(m), call.stage, "input", "rank 1"); });
    EXPECT_NE(msg.find(dropped), std::string::npos) << msg;
  }
}

TEST(Wire, EveryTruncationAndCorruptLengthIsAnErrorNotACrash) {
  WireMessage m;
  m.op = WireOp::Result;
  m.stage = "layers_0_3";
  m.sequences = {3};
  m.tensors.emplace("hidden_states", HostTensor(Shape{1, 2, 4}, std::vector<float>(8, 1.5f)));
  m.tensors.emplace("positions", HostTensor(Shape{2}, std::vector<int32_t>{4, 5}));
  const auto bytes = encode_wire_message(m);
  for (size_t n = 0; n < bytes.size(); ++n) {
    const std::string msg =
        error_of([&] { decode_wire_message(std::span<const uint8_t>(bytes.data(), n), "rank 2"); });
    EXPECT_NE(msg.find("rank 2"), std::string::npos) << n;
  }
  // Every single byte set to 0xff: decodes or fails with an Error, never reads out of bounds.
  for (size_t i = 0; i < bytes.size(); ++i) {
    auto bad = bytes;
    bad[i] = 0xff;
    try {
      decode_wire_message(bad, "rank 2");
    } catch (const Error&) {
    }
  }
  auto trailing = bytes;
  trailing.push_back(0);
  EXPECT_NE(error_of([&] { decode_wire_message(trailing, "rank 2"); }).find("trailing"),
            std::string::npos);
}

TEST(Wire, FailureCarriesItsMessage) {
  WireMessage m;
  m.op = WireOp::Failure;
  m.sequences = {11};
  m.error = "stage layers_3_6 on host b: out of memory";
  const WireMessage back = decode_wire_message(encode_wire_message(m), "rank 0");
  EXPECT_EQ(back.op, WireOp::Failure);
  EXPECT_EQ(back.error, m.error);
  EXPECT_TRUE(back.tensors.empty());
}

TEST(Placement, DefaultPutsLayersOnWorkersInOrder) {
  const std::vector<std::string> ids{"embeddings", "layers_0_2", "layers_2_4", "layers_4_6",
                                     "final_norm_head"};
  const std::vector<bool> tf{false, true, true, true, false};
  const Placement p = default_placement(ids, tf, 3);
  EXPECT_EQ(p.at(0), (std::vector<std::string>{"embeddings", "final_norm_head"}));
  EXPECT_EQ(p.at(1), (std::vector<std::string>{"layers_0_2", "layers_2_4"}));
  EXPECT_EQ(p.at(2), (std::vector<std::string>{"layers_4_6"}));
  EXPECT_EQ(default_placement(ids, tf, 1).at(0), ids);
  EXPECT_NE(error_of([&] { default_placement(ids, tf, 5); }).find("transformer stages"),
            std::string::npos);
}

TEST(Placement, ParsesAndRejectsBadSpecs) {
  const std::vector<std::string> ids{"embeddings", "layers_0_3", "layers_3_6", "final_norm_head"};
  const Placement p =
      parse_placement("0=embeddings,final_norm_head 1=layers_0_3 2=layers_3_6", ids, 3);
  EXPECT_EQ(p.at(2), (std::vector<std::string>{"layers_3_6"}));
  EXPECT_NE(error_of([&] {
              parse_placement("0=embeddings,final_norm_head 1=layers_0_3", ids, 3);
            }).find("layers_3_6"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              parse_placement("0=embeddings,final_norm_head,layers_0_3 1=layers_0_3,layers_3_6",
                              ids, 2);
            }).find("placed twice"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_placement("3=embeddings", ids, 3); }).find("outside"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_placement("0=nope", ids, 1); }).find("nope"), std::string::npos);
}

TEST(Handshake, RefusesAnotherBundleNamingRankAndHost) {
  const Placement p{{0, {"embeddings", "final_norm_head"}}, {1, {"layers_0_6"}}};
  std::vector<RankIdentity> ids{{0, "hostA", "abc", {"embeddings", "final_norm_head"}},
                                {1, "hostB", "abc", {"layers_0_6"}}};
  for (auto& id : ids) id = decode_rank_identity(encode_rank_identity(id), "rank");
  EXPECT_NO_THROW(check_handshake("abc", p, ids));
  ids[1].manifest_sha256 = "def";
  std::string msg = error_of([&] { check_handshake("abc", p, ids); });
  EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("hostB"), std::string::npos) << msg;
  ids[1].manifest_sha256 = "abc";
  ids[1].stages_held.clear();
  msg = error_of([&] { check_handshake("abc", p, ids); });
  EXPECT_NE(msg.find("layers_0_6"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] { decode_rank_identity("{", "rank 4"); }).find("rank 4"),
            std::string::npos);
}

}  // namespace
}  // namespace gemstage

// ---- The whole protocol in one process: the front's RemoteStageClients talk to StageWorkers
// through encode/decode, as they do over MPI, so every byte a rank would see crosses the wire
// format and the receiving contract.

namespace gemstage {
namespace {

// Worker "ranks" in this process. Each opens the bundle with only its own stages, like a worker
// rank does. `kill(rank)` makes the rank fall silent, as a dead process does.
class LoopbackTransport final : public StageTransport {
 public:
  LoopbackTransport(const std::string& bundle, const Placement& placement) {
    for (const auto& [rank, ids] : placement) {
      if (rank == 0) continue;
      auto model = Model::open(bundle, StagePlacementOptions{{ids.begin(), ids.end()}, nullptr});
      workers_[rank] = std::make_unique<StageWorker>(model, pool_, rank_name(rank));
      models_.push_back(model);
    }
  }
  // The worker handles the request at once; its reply is held back until ready() was asked
  // twice, as a far rank's reply takes time, so a pipeline really has several calls in flight.
  uint64_t post(int rank, const std::vector<uint8_t>& request, bool want_reply) override {
    std::lock_guard<std::mutex> lk(mu_);
    ++messages;
    if (dead_.count(rank)) fail("no answer within 0 s (test: rank killed)");
    auto reply = workers_.at(rank)->handle(decode_wire_message(request, rank_name(rank)));
    EXPECT_EQ(reply.has_value(), want_reply);
    if (!reply) return 0;
    replies_[++last_] = {encode_wire_message(*reply), 0};
    max_outstanding = std::max(max_outstanding, replies_.size());
    return last_;
  }
  bool ready(uint64_t ticket) override {
    std::lock_guard<std::mutex> lk(mu_);
    return ++replies_.at(ticket).second > 2;
  }
  std::vector<uint8_t> take(uint64_t ticket) override {
    std::lock_guard<std::mutex> lk(mu_);
    auto node = replies_.extract(ticket);
    if (node.empty()) fail("loopback: ticket ", ticket, " taken twice or never given");
    return std::move(node.mapped().first);
  }
  std::string rank_name(int rank) const override {
    return "rank " + std::to_string(rank) + " (host loop" + std::to_string(rank) + ")";
  }
  void kill(int rank) { dead_.insert(rank); }
  size_t sequences(int rank) const { return workers_.at(rank)->sequences(); }
  int messages = 0;
  size_t max_outstanding = 0;  // most replies given out and not yet taken at once

 private:
  std::mutex mu_;
  uint64_t last_ = 0;
  std::map<uint64_t, std::pair<std::vector<uint8_t>, int>> replies_;  // reply, ready() asks
  ThreadPool pool_{1};
  std::vector<std::shared_ptr<const Model>> models_;
  std::map<int, std::unique_ptr<StageWorker>> workers_;
  std::set<int> dead_;
};

struct SplitModel {
  std::shared_ptr<LoopbackTransport> transport;
  std::shared_ptr<const Model> model;
};

// The tiny model as an f32 bundle of two transformer stages; rank 0 the embeddings and head,
// ranks 1 and 2 one transformer stage each.
std::string split_bundle() {
  static const std::string dir = [] {
    const std::string d = testing::temp_dir("loopback_bundle") + "/b";
    ExportOptions o;
    o.stages = "2";
    o.weights = "f32";
    o.progress = false;
    export_bundle(testing::fixture("model"), d, o);
    return d;
  }();
  return dir;
}

SplitModel open_split() {
  const std::string bundle = split_bundle();
  const BundleManifest bm = read_bundle_manifest(bundle);
  std::vector<std::string> ids;
  std::vector<bool> tf;
  for (const auto& s : bm.stages) {
    ids.push_back(s.decl.id);
    tf.push_back(s.decl.role == StageRole::TransformerLayers);
  }
  const Placement p = default_placement(ids, tf, 3);
  SplitModel m;
  m.transport = std::make_shared<LoopbackTransport>(bundle, p);
  std::map<std::string, int> rank_of;
  for (const auto& [r, list] : p)
    for (const auto& id : list) rank_of[id] = r;
  StagePlacementOptions o;
  o.local.insert(p.at(0).begin(), p.at(0).end());
  // Each remote stage's decode bytes, as its rank reports them at the handshake.
  const auto whole = Model::open(bundle);
  std::map<std::string, double> bytes;
  for (const auto& s : whole->stages()) bytes[s->id()] = s->decode_weight_bytes();
  o.remote = [&](const StageDecl& d) -> std::unique_ptr<RemoteStage> {
    return std::make_unique<RemoteStageClient>(d, rank_of.at(d.id), m.transport, bytes.at(d.id));
  };
  m.model = Model::open(bundle, o);
  return m;
}

void expect_same(const FloatTensor& a, const FloatTensor& b, const std::string& what) {
  ASSERT_EQ(a.shape, b.shape) << what;
  for (size_t i = 0; i < a.data.size(); ++i)
    ASSERT_EQ(a.data[i], b.data[i]) << what << " element " << i;
}

TEST(RemoteStages, SplitRunEqualsOneProcessBitForBit) {
  const auto whole = Model::open(split_bundle());
  SplitModel split = open_split();
  ASSERT_EQ(split.model->stages()[1], nullptr);
  ASSERT_NE(split.model->remote_stages()[1], nullptr);
  const std::vector<int32_t> ids = testing::load_ids(testing::fixture("text/input_ids.npy"));
  ThreadPool pool(1);
  Sequence a(whole), b(split.model);
  const FloatTensor la = a.prefill(pool, ids, nullptr, 5, true, nullptr);
  const FloatTensor lb = b.prefill(pool, ids, nullptr, 5, true, nullptr);
  expect_same(la, lb, "prefill logits");
  // Greedy decode; each step's logits equal.
  for (int step = 0; step < 4; ++step) {
    const int32_t next = static_cast<int32_t>(
        std::max_element(la.data.end() - la.dim(1), la.data.end()) - (la.data.end() - la.dim(1)));
    const std::vector<int32_t> one{next};
    expect_same(a.forward(pool, one, nullptr, false, nullptr),
                b.forward(pool, one, nullptr, false, nullptr), "decode step");
  }
  // Roll back and run again: the far caches forget the same positions.
  ASSERT_TRUE(a.truncate(3));
  ASSERT_TRUE(b.truncate(3));
  const std::vector<int32_t> more(ids.begin() + 3, ids.end());
  expect_same(a.forward(pool, more, nullptr, true, nullptr),
              b.forward(pool, more, nullptr, true, nullptr), "after truncate");
}

TEST(RemoteStages, BatchedSequencesKeepTheirOwnFarCaches) {
  const auto whole = Model::open(split_bundle());
  SplitModel split = open_split();
  const std::vector<int32_t> ids = testing::load_ids(testing::fixture("text/input_ids.npy"));
  const std::vector<int32_t> p1(ids.begin(), ids.begin() + 6), p2(ids.begin() + 2, ids.end());
  ThreadPool pool(1);
  Sequence a1(whole), a2(whole), b1(split.model), b2(split.model);
  EXPECT_EQ(split.transport->sequences(1), 2u);
  const BatchEntry wa[] = {{&a1, p1, nullptr, true}, {&a2, p2, nullptr, false}};
  const BatchEntry wb[] = {{&b1, p1, nullptr, true}, {&b2, p2, nullptr, false}};
  auto la = Sequence::forward_batch(pool, wa);
  auto lb = Sequence::forward_batch(pool, wb);
  for (size_t k = 0; k < 2; ++k) expect_same(la[k], lb[k], "batch entry " + std::to_string(k));
  // And each sequence alone afterwards continues from its own cache.
  const std::vector<int32_t> next{7};
  expect_same(a2.forward(pool, next, nullptr, false, nullptr),
              b2.forward(pool, next, nullptr, false, nullptr), "second sequence alone");
  {
    Sequence gone(split.model);
    EXPECT_EQ(split.transport->sequences(1), 3u);
  }
  EXPECT_EQ(split.transport->sequences(1), 2u) << "a destroyed sequence is freed on its ranks";
}

TEST(RemoteStages, AFailedCallLeavesTheSequenceAsItWasAndADeadRankFailsEverythingAfter) {
  SplitModel split = open_split();
  const std::vector<int32_t> ids = testing::load_ids(testing::fixture("text/input_ids.npy"));
  ThreadPool pool(1);
  Sequence s(split.model, 16);
  s.prefill(pool, std::span<const int32_t>(ids.data(), 4), nullptr, 0, false, nullptr);
  // Past the context: refused before anything runs, nothing changes.
  const std::vector<int32_t> too_many(20, 5);
  EXPECT_THROW(s.forward(pool, too_many, nullptr, false, nullptr), Error);
  EXPECT_EQ(s.n_past(), 4);
  // Rank 2 (the last transformer stage) dies: the call fails naming stage, rank and host...
  split.transport->kill(2);
  std::string msg;
  try {
    s.forward(pool, std::span<const int32_t>(ids.data() + 4, 1), nullptr, false, nullptr);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("layers_2_6"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 2 (host loop2)"), std::string::npos) << msg;
  EXPECT_EQ(s.n_past(), 4);
  // ... the model reports it, and every later call fails at once with the same message, without
  // sending anything; resetting a sequence does not throw.
  EXPECT_EQ(split.model->stage_failure(), msg);
  const int sent = split.transport->messages;
  EXPECT_THROW(
      s.forward(pool, std::span<const int32_t>(ids.data() + 4, 1), nullptr, false, nullptr), Error);
  EXPECT_NO_THROW(s.reset());
  EXPECT_FALSE(s.truncate(2));
  EXPECT_LE(split.transport->messages - sent, 3);
}

int32_t greedy_last(const FloatTensor& l) {
  const auto row = l.data.end() - l.dim(1);
  return static_cast<int32_t>(std::max_element(row, l.data.end()) - row);
}

// Four sequences decoding as two calls kept in flight together (as serve and bench do with
// stages on other ranks): each call's logits equal those of the same call run alone on the
// whole model, bit for bit, whatever order the calls finish in.
TEST(RemoteStages, PipelinedCallsInFlightTogetherGiveWhatEachGetsAlone) {
  const auto whole = Model::open(split_bundle());
  SplitModel split = open_split();
  EXPECT_EQ(CallPipeline::depth(*whole), 1);
  EXPECT_EQ(CallPipeline::depth(*split.model), 3) << "the front and ranks 1 and 2";
  EXPECT_EQ(CallPipeline::depth(*split.model, 2), 2) << "--pipeline-depth";
  EXPECT_EQ(CallPipeline::depth(*split.model, 0), 3) << "0: automatic";
  const std::vector<int32_t> ids = testing::load_ids(testing::fixture("text/input_ids.npy"));
  ThreadPool pool(1);
  std::vector<std::unique_ptr<Sequence>> a, b;
  for (int k = 0; k < 4; ++k) {
    a.push_back(std::make_unique<Sequence>(whole));
    b.push_back(std::make_unique<Sequence>(split.model));
    const std::vector<int32_t> prompt(ids.begin() + k, ids.end());
    a[k]->forward(pool, prompt, nullptr, false, nullptr);
    b[k]->forward(pool, prompt, nullptr, false, nullptr);
  }
  // The reference: group g = sequences {g, g + 2}, one call per step, each group on its own.
  constexpr int kSteps = 5;
  std::vector<std::vector<FloatTensor>> want(2);
  std::vector<std::vector<int32_t>> next(2, std::vector<int32_t>(2, 3));
  for (int g = 0; g < 2; ++g)
    for (int step = 0; step < kSteps; ++step) {
      const BatchEntry e[] = {
          {a[g].get(), std::span<const int32_t>(&next[g][0], 1), nullptr, false},
          {a[g + 2].get(), std::span<const int32_t>(&next[g][1], 1), nullptr, false}};
      auto l = Sequence::forward_batch(pool, e);
      for (int k = 0; k < 2; ++k) next[g][k] = greedy_last(l[k]);
      want[g].push_back(std::move(l[0]));
      want[g].push_back(std::move(l[1]));
    }
  // Pipelined on the split model.
  CallPipeline pipeline(pool);
  std::vector<std::vector<int32_t>> feed(2, std::vector<int32_t>(2, 3));
  std::vector<int> steps(2, 0);
  std::map<uint64_t, int> group_of;
  auto start = [&](int g) {
    const BatchEntry e[] = {
        {b[g].get(), std::span<const int32_t>(&feed[g][0], 1), nullptr, false},
        {b[g + 2].get(), std::span<const int32_t>(&feed[g][1], 1), nullptr, false}};
    group_of[pipeline.start(e)] = g;
  };
  start(0);
  start(1);
  EXPECT_EQ(pipeline.in_flight(), 2u);
  while (pipeline.in_flight() > 0) {
    CallPipeline::Finished f = pipeline.next();
    ASSERT_FALSE(f.error);
    const int g = group_of.at(f.call);
    const int step = steps[g]++;
    for (int k = 0; k < 2; ++k) {
      expect_same(f.logits[k], want[g][2 * step + k],
                  "group " + std::to_string(g) + " step " + std::to_string(step));
      feed[g][k] = greedy_last(f.logits[k]);
    }
    if (steps[g] < kSteps) start(g);
  }
  EXPECT_EQ(steps, (std::vector<int>{kSteps, kSteps}));
  EXPECT_GE(split.transport->max_outstanding, 2u) << "two calls were never in flight at once";

  // Calls dropped in flight leave their sequences as they were, here and on the ranks.
  const int64_t before = b[0]->n_past();
  {
    const int32_t one = 5;
    const BatchEntry e[] = {{b[0].get(), std::span<const int32_t>(&one, 1), nullptr, false}};
    BatchCall dropped(e);
    dropped.advance(pool);  // the embeddings ran here; rank 1 has the call
    ASSERT_FALSE(dropped.done());
    dropped.advance(pool);  // rank 1's rows are in its caches, rank 2 has the call
    ASSERT_EQ(dropped.stages_run(), 2u);
  }
  EXPECT_EQ(b[0]->n_past(), before);
  const std::vector<int32_t> more{9};
  expect_same(a[0]->forward(pool, more, nullptr, false, nullptr),
              b[0]->forward(pool, more, nullptr, false, nullptr), "after a dropped call");

  // A rank that dies fails every call in flight, each leaving its sequences as they were.
  split.transport->kill(2);
  const int64_t n1 = b[1]->n_past(), n2 = b[2]->n_past();
  CallPipeline failing(pool);
  const int32_t x = 4, y = 6;
  const BatchEntry e1[] = {{b[1].get(), std::span<const int32_t>(&x, 1), nullptr, false}};
  const BatchEntry e2[] = {{b[2].get(), std::span<const int32_t>(&y, 1), nullptr, false}};
  failing.start(e1);
  failing.start(e2);
  for (int k = 0; k < 2; ++k) EXPECT_TRUE(failing.next().error);
  EXPECT_EQ(b[1]->n_past(), n1);
  EXPECT_EQ(b[2]->n_past(), n2);
}

TEST(StageWorkerProtocol, RefusesUnknownSequencesAndStagesByName) {
  const std::string bundle = split_bundle();
  auto model = Model::open(bundle, StagePlacementOptions{{"layers_0_2"}, nullptr});
  ThreadPool pool(1);
  StageWorker w(model, pool, "rank 1 (host h)");
  WireMessage m;
  m.op = WireOp::Truncate;
  m.stage = "layers_0_2";
  m.sequences = {99};
  auto r = w.handle(m);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->op, WireOp::Failure);
  EXPECT_NE(r->error.find("sequence 99"), std::string::npos) << r->error;
  m.stage = "layers_2_6";
  r = w.handle(m);
  ASSERT_TRUE(r);
  EXPECT_NE(r->error.find("layers_2_6 is not held by rank 1 (host h)"), std::string::npos)
      << r->error;
  // An error in a message without a reply comes back with the next one that has one.
  m.op = WireOp::Commit;
  m.stage = "layers_0_2";
  EXPECT_FALSE(w.handle(m));
  m.op = WireOp::CreateSequence;
  m.length = 8;
  r = w.handle(m);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->op, WireOp::Failure);
  EXPECT_NE(r->error.find("sequence 99"), std::string::npos) << r->error;
  r = w.handle(m);
  EXPECT_EQ(r->op, WireOp::Result);
}

// ------------------------------------------------------------------------------------------
// The engine (runtime/engine.h): every front end's scheduler gives each request what a plain
// decode loop on the whole model gives it, alone or batched with others, with the stages in this
// process or spread over (loopback) ranks with calls pipelined; and two models at two CPU tiers
// and placements run side by side in one process.

// Greedy ids after `prompt`, from a plain loop of forward calls (not the engine).
std::vector<int32_t> plain_greedy(const std::shared_ptr<const Model>& model, ThreadPool& pool,
                                  const std::vector<int32_t>& prompt, int n) {
  Sequence seq(model);
  FloatTensor l = seq.forward(pool, prompt, nullptr, false, nullptr);
  std::vector<int32_t> ids;
  for (int i = 0; i < n; ++i) {
    const float* row = l.row(l.dim(0) - 1);
    ids.push_back(static_cast<int32_t>(std::max_element(row, row + l.dim(1)) - row));
    l = seq.forward(pool, std::span<const int32_t>(&ids.back(), 1), nullptr, false, nullptr);
  }
  return ids;
}

// Greedy ids of each prompt, all submitted at once to an engine of `slots` slots.
std::vector<std::vector<int32_t>> engine_greedy(const std::shared_ptr<const Model>& model,
                                                ThreadPool& pool,
                                                const std::vector<std::vector<int32_t>>& prompts,
                                                int n, int slots) {
  EngineOptions eo;
  eo.slots = slots;
  eo.kv_budget = 256;
  eo.batch_rows = eo.ubatch_rows = 7;  // prompts in several chunks, decode rows beside them
  eo.kv_type = KvType::F32;
  Engine engine(model, nullptr, pool, eo);
  std::vector<std::shared_ptr<Generation>> gens;
  for (const auto& p : prompts) {
    EngineRequest r;
    r.ids = p;
    r.gen.max_tokens = n;
    r.gen.sampling = SamplingParams::greedy();
    gens.push_back(engine.submit(std::move(r)));
  }
  engine.run_until_idle();
  std::vector<std::vector<int32_t>> out;
  for (const auto& g : gens) {
    const Generation::Result r = g->result();
    EXPECT_FALSE(r.error) << (r.error ? r.error->message : "");
    EXPECT_EQ(r.generation.finish_reason, "length");
    out.push_back(r.generation.tokens);
  }
  return out;
}

std::vector<std::vector<int32_t>> three_prompts() {
  const std::vector<int32_t> ids = testing::load_ids(testing::fixture("text/input_ids.npy"));
  return {ids, std::vector<int32_t>(ids.begin() + 3, ids.end()),
          std::vector<int32_t>(ids.begin(), ids.begin() + 5)};
}

TEST(Engine, GreedyIdsEqualAPlainLoopAloneBatchedAndOverRemoteStages) {
  const auto whole = Model::open(split_bundle());
  ThreadPool pool(2);
  const auto prompts = three_prompts();
  std::vector<std::vector<int32_t>> want;
  for (const auto& p : prompts) want.push_back(plain_greedy(whole, pool, p, 12));
  ASSERT_EQ(want[0].size(), 12u);
  // One slot: the requests run one after another.
  EXPECT_EQ(engine_greedy(whole, pool, prompts, 12, 1), want);
  // Three slots: batched together, prompt chunks beside decode rows.
  EXPECT_EQ(engine_greedy(whole, pool, prompts, 12, 3), want);
  // The transformer stages on two loopback ranks: calls pipelined over them (depth 3).
  SplitModel split = open_split();
  EXPECT_EQ(CallPipeline::depth(*split.model), 3);
  EXPECT_EQ(engine_greedy(split.model, pool, prompts, 12, 3), want);
  EXPECT_GT(split.transport->max_outstanding, 1u) << "calls were in flight together";
}

// Nothing about how a model runs is process state: a model on the scalar tier with every stage
// here and one on the best tier with its stages on loopback ranks run at the same time on two
// threads, each giving what it gives alone.
TEST(Engine, TwoModelsAtTwoTiersAndPlacementsRunConcurrentlyInOneProcess) {
  const auto whole = Model::open(split_bundle());
  SplitModel split = open_split();
  ThreadPool scalar_pool(1, CpuTier::Scalar), best_pool(2, cpu_best_tier());
  const auto prompts = three_prompts();
  const auto alone_a = engine_greedy(whole, scalar_pool, prompts, 8, 2);
  const auto alone_b = engine_greedy(split.model, best_pool, prompts, 8, 3);
  std::vector<std::vector<int32_t>> together_a, together_b;
  std::thread a([&] { together_a = engine_greedy(whole, scalar_pool, prompts, 8, 2); });
  std::thread b([&] { together_b = engine_greedy(split.model, best_pool, prompts, 8, 3); });
  a.join();
  b.join();
  EXPECT_EQ(together_a, alone_a);
  EXPECT_EQ(together_b, alone_b);
  ASSERT_EQ(alone_a[0].size(), 8u);
}

// A request cancelled while it waits in the queue never starts; one cancelled while it runs ends
// as "cancelled" at the next step, and its slot's rows are dropped.
TEST(Engine, CancelledRequestsEndAndFreeTheirSlot) {
  const auto whole = Model::open(split_bundle());
  ThreadPool pool(1);
  EngineOptions eo;
  eo.kv_budget = 128;
  int steps = 0;
  std::shared_ptr<Generation> running;
  eo.before_step = [&] {
    if (++steps == 3) running->cancel();
  };
  Engine engine(whole, nullptr, pool, eo);
  EngineRequest r;
  r.ids = three_prompts()[0];
  r.gen.max_tokens = 50;
  r.gen.sampling = SamplingParams::greedy();
  running = engine.submit(r);
  const std::shared_ptr<Generation> queued = engine.submit(r);
  queued->cancel();
  engine.run_until_idle();
  const Generation::Result a = running->result(), b = queued->result();
  EXPECT_FALSE(a.error);
  EXPECT_EQ(a.generation.finish_reason, "cancelled");
  EXPECT_LT(a.generation.tokens.size(), 50u);
  ASSERT_TRUE(b.error);
  EXPECT_EQ(b.error->kind, EngineError::Kind::kCancelled);
  EXPECT_EQ(engine.stats().kv_rows_used, 0) << "a cancelled request's rows are dropped";
  // A prompt that leaves no room is refused at submit, naming the reason.
  r.ids.assign(128, 5);
  try {
    engine.submit(r);
    ADD_FAILURE() << "a prompt filling the context was accepted";
  } catch (const RequestRejected& e) {
    EXPECT_EQ(e.reason(), RequestRejected::Reason::kPromptTooLong) << e.what();
  }
}

}  // namespace
}  // namespace gemstage
