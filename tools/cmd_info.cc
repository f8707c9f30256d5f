#include "tools/commands.h"

namespace gemstage::cli {
void add_info_command(CLI::App& app, Registry& reg) {
  auto* sub = app.add_subcommand("info", "(not yet implemented)");
  reg.add(sub, [] { return 2; });
}
}  // namespace gemstage::cli
