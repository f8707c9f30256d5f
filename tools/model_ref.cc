#include "tools/model_ref.h"

#include <filesystem>
#include <iostream>

#include "core/error.h"
#include "hub/download.h"
#include "hub/model_ref.h"
#include "hub/settings.h"

namespace gemstage::cli {

namespace {

bool help_requested(const CLI::App* app) {
  for (const CLI::App* a = app; a != nullptr; a = a->get_parent()) {
    if (const CLI::Option* h = a->get_help_ptr(); h && h->count() > 0) return true;
    if (const CLI::Option* h = a->get_help_all_ptr(); h && h->count() > 0) return true;
  }
  return false;
}

}  // namespace

std::string resolve_model_argument(const std::string& value) {
  std::error_code ec;
  if (value.empty() || std::filesystem::exists(value, ec)) return value;
  const auto ref = hub::parse_model_ref(value);
  if (!ref) {
    // llama.cpp's -hf takes ORG/NAME:QUANT, a GGUF file of the repository.
    const size_t colon = value.find(':');
    if (colon != std::string::npos && hub::parse_model_ref(value.substr(0, colon)))
      fail("'", value,
           "': a :TAG names a GGUF quantization (llama.cpp's -hf); gemstage reads the safetensors "
           "checkpoint itself, named ORG/NAME[@REVISION]");
    return value;  // a path that does not exist: the command says so, naming it
  }
  hub::ResolvedModel m;
  try {
    m = hub::resolve_model(*ref, hub::settings_from_environment());
  } catch (const hub::HubError& e) {
    if (e.kind() == hub::HubError::Kind::RepoNotFound || e.kind() == hub::HubError::Kind::NotCached)
      fail(e.what(), " (and no local path '", value, "' exists)");
    throw;
  }
  std::cerr << "model " << ref->display() << ": commit " << m.commit << " in " << m.dir.string()
            << "\n";
  return m.dir.string();
}

void accept_model_references(Registry& reg) {
  for (auto& [sub, action] : reg.commands) {
    if (sub->get_option_no_throw("--model") && sub->get_footer().empty())
      sub->footer(
          "-m/--model (and --model-draft) also take a model on the Hugging Face Hub, "
          "ORG/NAME[@REVISION] (-hf ORG/NAME is the same), from the shared Hugging Face cache "
          "(HF_HUB_CACHE) or downloaded into it; see docs/models-by-name.md.");
    // check's --reference is the source checkpoint too (parity's is a dump folder).
    const bool check = sub->get_name() == "check";
    for (const char* name : {"--model", "--model-draft", check ? "--reference" : nullptr}) {
      if (name == nullptr) continue;
      CLI::Option* opt = sub->get_option_no_throw(name);
      if (opt == nullptr) continue;
      CLI::App* owner = sub;
      opt->transform([owner](std::string value) {
        if (help_requested(owner)) return value;
        return resolve_model_argument(value);
      });
    }
  }
}

}  // namespace gemstage::cli
