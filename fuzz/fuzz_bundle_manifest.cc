// A bundle's manifest.json (stage/bundle.h): schema version, model_config, stage declarations and
// their contracts, cache groups, copied files. Reading it must refuse every malformed field with
// an Error naming the manifest; a manifest that reads must also pass or fail the contract-chain
// check the same way, since `check` and Model::open run it next.
#include "fuzz_util.h"
#include "stage/bundle.h"
#include "stage/contract.h"

using namespace gemstage;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = [] {
    const std::string d = fuzz::scratch_dir() + "/bundle";
    std::filesystem::create_directories(d);
    return d;
  }();
  fuzz::write_scratch("bundle/manifest.json", data, size);
  fuzz::expect_error_or_success([&] {
    const BundleManifest m = read_bundle_manifest(dir);
    std::vector<StageDecl> decls;
    for (const BundleStage& s : m.stages) decls.push_back(s.decl);
    check_contract_chain(decls, m.config);
  });
  return 0;
}
