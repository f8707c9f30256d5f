// gemstage ls: the models in the shared Hugging Face cache and whether gemstage runs them.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "hub/cache.h"
#include "hub/settings.h"
#include "hub/transfer_progress.h"
#include "tools/commands.h"

namespace gemstage::cli {

namespace {

// The last column of `gemstage ls`: what gemstage can do with the snapshot.
std::string verdict(const hub::CachedSnapshot& s) {
  if (s.commit.empty()) return "no (download in progress or cut short)";
  if (!s.missing.empty()) {
    std::string list;
    for (const auto& m : s.missing) list += (list.empty() ? "" : ", ") + m;
    return "no (incomplete: lacks " + list + ")";
  }
  const std::string role = hub::gemstage_role(s.model_type);
  if (role == "model") return "yes";
  if (role == "drafter") return "yes (drafter, for -md)";
  return "no (model_type " + (s.model_type.empty() ? std::string("unknown") : s.model_type) + ")";
}

}  // namespace

void add_ls_command(CLI::App& app, Registry& reg) {
  auto* sub = app.add_subcommand(
      "ls",
      "List the models in the Hugging Face cache (HF_HUB_CACHE): name, revision, commit, "
      "size, and whether gemstage runs them");
  struct Args {
    bool json = false;
  };
  auto& a = reg.args<Args>();
  sub->add_flag("--json", a.json, "one JSON array instead of the table");
  reg.add(sub, [&a] {
    const hub::HubSettings s = hub::settings_from_environment();
    const auto models = hub::list_cached_models(s.cache_dir);
    if (a.json) {
      nlohmann::json out = nlohmann::json::array();
      for (const auto& m : models)
        out.push_back({{"model", m.repo_id},
                       {"commit", m.commit},
                       {"refs", m.refs},
                       {"bytes", m.bytes},
                       {"partial_bytes", m.partial_bytes},
                       {"model_type", m.model_type},
                       {"missing", m.missing},
                       {"runs", m.missing.empty() && !m.commit.empty() &&
                                    !hub::gemstage_role(m.model_type).empty()},
                       {"path", m.dir.string()}});
      std::cout << out.dump(2) << "\n";
      return 0;
    }
    std::cerr << "cache: " << s.cache_dir.string() << "\n";
    if (models.empty()) {
      std::cerr << "no models (gemstage pull ORG/NAME downloads one)\n";
      return 0;
    }
    std::printf("%-40s %-12s %-12s %10s  %s\n", "MODEL", "REVISION", "COMMIT", "SIZE", "GEMSTAGE");
    for (const auto& m : models) {
      std::string refs;
      for (const auto& r : m.refs) refs += (refs.empty() ? "" : ",") + r;
      std::string size = hub::human_bytes(m.bytes);
      if (m.partial_bytes > 0) size += " +" + hub::human_bytes(m.partial_bytes) + " partial";
      std::printf("%-40s %-12s %-12s %10s  %s\n", m.repo_id.c_str(),
                  refs.empty() ? "-" : refs.c_str(),
                  m.commit.empty() ? "-" : m.commit.substr(0, 12).c_str(), size.c_str(),
                  verdict(m).c_str());
    }
    return 0;
  });
}

}  // namespace gemstage::cli
