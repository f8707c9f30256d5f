// Stage messages from another rank (distributed/wire.h): the header, sequence numbers, error
// text and named tensors, then the check against a transformer stage's contract, as a worker
// does with each message it receives.
#include "distributed/wire.h"
#include "fuzz_util.h"
#include "gemma4/config.h"

using namespace gemstage;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const StageDecl stage = [] {
    const ModelConfig c = load_model_config(GEMSTAGE_FUZZ_MODEL_DIR);
    StageDecl d;
    d.id = "layers_0_2";
    d.role = StageRole::TransformerLayers;
    d.layers = {0, 2};
    d.contract = contract_for(d.role, d.layers, c);
    return d;
  }();
  fuzz::expect_error_or_success([&] {
    const WireMessage m = decode_wire_message(std::span<const uint8_t>(data, size), "rank 1");
    (void)encode_wire_message(m);
    check_wire_tensors(m, stage, "input");
  });
  return 0;
}
