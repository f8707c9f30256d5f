// The stage wire format, placement and handshake of issue 22 (no MPI needed).
#include <gtest/gtest.h>

#include <cstring>
#include <functional>

#include "core/error.h"
#include "distributed/placement.h"
#include "distributed/wire.h"
#include "gemma4/config.h"
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
