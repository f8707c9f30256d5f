// gemstage tokenize / detokenize: the tokenizer on its own, for inspection and parity scripts.
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "io/mapped_file.h"
#include "tokenizer/tokenizer.h"
#include "tools/commands.h"

namespace gemstage::cli {
namespace {

struct TokenizerSource {
  std::string file;
  std::string model_dir;
};

void add_source_options(CLI::App* sub, TokenizerSource& src) {
  auto* file = sub->add_option("--tokenizer", src.file, "tokenizer.json to load");
  auto* dir = sub->add_option("--model", src.model_dir,
                              "model directory (tokenizer.json + tokenizer_config.json)");
  file->excludes(dir);
  dir->excludes(file);
}

Tokenizer load(const TokenizerSource& src) {
  if (!src.file.empty()) return Tokenizer::from_file(src.file);
  if (!src.model_dir.empty()) return Tokenizer::from_model_dir(src.model_dir);
  fail("pass --tokenizer FILE or --model DIR");
}

std::vector<int32_t> parse_id_list(const std::string& text) {
  std::vector<int32_t> ids;
  std::string cleaned = text;
  for (char& c : cleaned)
    if (c == ',' || c == '[' || c == ']') c = ' ';
  std::istringstream in(cleaned);
  std::string word;
  while (in >> word) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != word.size() || v < 0 || v > INT32_MAX)
      fail("--ids: \"", word, "\" is not a token id (expected non-negative integers)");
    ids.push_back(static_cast<int32_t>(v));
  }
  return ids;
}

std::vector<int32_t> ids_from_json(const nlohmann::json& j, const std::string& where) {
  if (!j.is_array()) fail(where, ": expected a JSON array of token ids");
  std::vector<int32_t> ids;
  for (const auto& e : j) {
    if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() > INT32_MAX)
      fail(where, ": ", e.dump(), " is not a token id");
    ids.push_back(static_cast<int32_t>(e.get<int64_t>()));
  }
  return ids;
}

nlohmann::json parse_json_file(const std::string& path) {
  try {
    return nlohmann::json::parse(read_text_file(path));
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": not valid JSON: ", e.what());
  }
}

}  // namespace

void add_tokenize_command(CLI::App& app, Registry& reg) {
  struct Options {
    TokenizerSource src;
    std::string text, text_file, batch_file;
    bool json = false, add_special = false, no_parse_special = false;
  };
  auto opt = std::make_shared<Options>();
  auto* sub = app.add_subcommand("tokenize", "Text to token ids (as HF tokenizer.encode)");
  add_source_options(sub, opt->src);
  auto* text = sub->add_option("--text", opt->text, "text to tokenize");
  auto* file = sub->add_option("--text-file", opt->text_file, "file whose bytes are the text");
  auto* batch = sub->add_option("--batch-json", opt->batch_file,
                                "JSON array of strings; prints a JSON array of id arrays");
  text->excludes(file)->excludes(batch);
  file->excludes(batch);
  sub->add_flag("--json", opt->json, "print one JSON array instead of space-separated ids");
  sub->add_flag("--add-special", opt->add_special,
                "add the BOS/EOS the tokenizer's post processor (or tokenizer_config) asks for");
  sub->add_flag("--no-parse-special", opt->no_parse_special,
                "treat special-token strings in the text as plain text");
  reg.add(sub, [opt, sub] {
    const Tokenizer tok = load(opt->src);
    const bool parse_special = !opt->no_parse_special;
    if (!opt->batch_file.empty()) {
      const nlohmann::json texts = parse_json_file(opt->batch_file);
      if (!texts.is_array()) fail(opt->batch_file, ": expected a JSON array of strings");
      nlohmann::json out = nlohmann::json::array();
      for (const auto& t : texts) {
        if (!t.is_string()) fail(opt->batch_file, ": every entry must be a string");
        out.push_back(tok.encode(t.get<std::string>(), opt->add_special, parse_special));
      }
      std::cout << out.dump() << "\n";
      return 0;
    }
    std::string input;
    if (!opt->text_file.empty())
      input = read_text_file(opt->text_file);
    else if (sub->count("--text"))
      input = opt->text;
    else
      fail("tokenize: pass --text STR, --text-file FILE or --batch-json FILE");
    const std::vector<int32_t> ids = tok.encode(input, opt->add_special, parse_special);
    if (opt->json) {
      std::cout << nlohmann::json(ids).dump() << "\n";
    } else {
      for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? " " : "") << ids[i];
      std::cout << "\n";
    }
    return 0;
  });
}

void add_detokenize_command(CLI::App& app, Registry& reg) {
  struct Options {
    TokenizerSource src;
    std::string ids, ids_file, batch_file;
    bool json = false, skip_special = false, stream = false;
  };
  auto opt = std::make_shared<Options>();
  auto* sub = app.add_subcommand(
      "detokenize", "Token ids to text (as HF tokenizer.decode); prints the text with no newline");
  add_source_options(sub, opt->src);
  auto* ids = sub->add_option("--ids", opt->ids, "ids separated by spaces or commas");
  auto* file = sub->add_option("--ids-file", opt->ids_file, "JSON file holding an array of ids");
  auto* batch = sub->add_option("--batch-json", opt->batch_file,
                                "JSON array of id arrays; prints a JSON array of strings");
  ids->excludes(file)->excludes(batch);
  file->excludes(batch);
  sub->add_flag("--json", opt->json, "print the text as a JSON string (with a newline)");
  sub->add_flag("--skip-special", opt->skip_special, "drop special tokens");
  sub->add_flag("--stream", opt->stream,
                "decode one id at a time as a streaming server does; with --json or --batch-json "
                "each text becomes the array of pieces emitted");
  reg.add(sub, [opt, sub] {
    const Tokenizer tok = load(opt->src);
    // Either the text, or (with --stream) the pieces the stream decoder emitted for it.
    const auto decode = [&](const std::vector<int32_t>& list) -> nlohmann::json {
      if (!opt->stream) return tok.decode(list, opt->skip_special);
      StreamDecoder stream(tok, opt->skip_special);
      nlohmann::json pieces = nlohmann::json::array();
      for (const int32_t id : list)
        if (std::string piece = stream.push(id); !piece.empty()) pieces.push_back(std::move(piece));
      if (std::string rest = stream.flush(); !rest.empty()) pieces.push_back(std::move(rest));
      return pieces;
    };
    if (!opt->batch_file.empty()) {
      const nlohmann::json lists = parse_json_file(opt->batch_file);
      if (!lists.is_array()) fail(opt->batch_file, ": expected a JSON array of id arrays");
      nlohmann::json out = nlohmann::json::array();
      for (const auto& l : lists) out.push_back(decode(ids_from_json(l, opt->batch_file)));
      std::cout << out.dump() << "\n";
      return 0;
    }
    std::vector<int32_t> given;
    if (!opt->ids_file.empty())
      given = ids_from_json(parse_json_file(opt->ids_file), opt->ids_file);
    else if (sub->count("--ids"))
      given = parse_id_list(opt->ids);
    else
      fail("detokenize: pass --ids \"1 2 3\", --ids-file FILE.json or --batch-json FILE");
    const nlohmann::json result = decode(given);
    if (opt->json) {
      std::cout << result.dump() << "\n";
    } else if (result.is_string()) {
      std::cout << result.get<std::string>();
    } else {
      for (const auto& piece : result) std::cout << piece.get<std::string>() << std::flush;
    }
    return 0;
  });
}

}  // namespace gemstage::cli
