// gemstage rm ORG/NAME[@REVISION]: a model, or one snapshot of it, out of the Hugging Face cache.
#include <iostream>

#include "core/error.h"
#include "hub/cache.h"
#include "hub/model_ref.h"
#include "hub/settings.h"
#include "hub/transfer_progress.h"
#include "tools/commands.h"

namespace gemstage::cli {

void add_rm_command(CLI::App& app, Registry& reg) {
  auto* sub = app.add_subcommand(
      "rm",
      "Remove a model from the Hugging Face cache: ORG/NAME all of it, ORG/NAME@REVISION "
      "one snapshot (and the blobs only it used)");
  struct Args {
    std::string model;
  };
  auto& a = reg.args<Args>();
  sub->add_option("MODEL", a.model, "ORG/NAME[@REVISION]")->required();
  reg.add(sub, [&a] {
    const auto ref = hub::parse_model_ref(a.model);
    if (!ref) fail("'", a.model, "' is not a Hub model name: ORG/NAME or ORG/NAME@REVISION");
    const hub::HubSettings s = hub::settings_from_environment();
    const auto report = hub::remove_cached_model(hub::HubCache(s.cache_dir), *ref);
    for (const auto& r : report.removed) std::cerr << "removed " << r << "\n";
    std::cerr << hub::human_bytes(report.bytes_freed) << " freed in " << s.cache_dir.string()
              << "\n";
    return 0;
  });
}

}  // namespace gemstage::cli
