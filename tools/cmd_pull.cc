// gemstage pull ORG/NAME[@REVISION]: the model into the shared Hugging Face cache, ahead of use.
#include <iostream>

#include "core/error.h"
#include "hub/download.h"
#include "hub/model_ref.h"
#include "hub/settings.h"
#include "hub/transfer_progress.h"
#include "tools/commands.h"

namespace gemstage::cli {

void add_pull_command(CLI::App& app, Registry& reg) {
  auto* sub = app.add_subcommand(
      "pull",
      "Download a model from the Hugging Face Hub into the shared Hugging Face cache: only the "
      "files gemstage reads, resumable, each checked against the Hub's sha256");
  struct Args {
    std::string model;
    int jobs = 8;
  };
  auto& a = reg.args<Args>();
  sub->add_option("MODEL", a.model, "ORG/NAME[@REVISION] (a branch, tag or commit; default main)")
      ->required();
  sub->add_option("-j,--jobs", a.jobs, "files downloaded at once")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  reg.add(sub, [&a] {
    const auto ref = hub::parse_model_ref(a.model);
    if (!ref) fail("'", a.model, "' is not a Hub model name: ORG/NAME or ORG/NAME@REVISION");
    hub::HubSettings s = hub::settings_from_environment();
    s.jobs = a.jobs;
    const hub::ResolvedModel m = hub::resolve_model(*ref, s);
    std::cerr << ref->display() << ": commit " << m.commit;
    if (m.files_downloaded > 0)
      std::cerr << ", " << m.files_downloaded << " file(s) downloaded ("
                << hub::human_bytes(m.bytes_downloaded) << ")";
    else
      std::cerr << ", nothing to download (all of it is in the cache)";
    std::cerr << "\n";
    std::cout << m.dir.string() << "\n";  // for scripts: the directory any command accepts
    return 0;
  });
}

}  // namespace gemstage::cli
