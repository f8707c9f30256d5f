#include "tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/mapped_file.h"
#include "test_util.h"
#include "tokenizer/utf8.h"

using namespace gemstage;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

const std::string kModelDir = std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny/model";
const std::string kTokenizerJson = kModelDir + "/tokenizer.json";

const Tokenizer& tiny() {
  static const Tokenizer tok = Tokenizer::from_model_dir(kModelDir);
  return tok;
}

fs::path scratch_dir(const std::string& name) {
  return gemstage::testing::temp_dir("tok_" + name);
}

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

json fixture_json() {
  return json::parse(read_text_file(kTokenizerJson));
}

// Writes a variant of the fixture tokenizer.json and loads it.
Tokenizer load_variant(const std::string& name, const json& j) {
  const fs::path path = scratch_dir(name) / "tokenizer.json";
  write_file(path, j.dump());
  return Tokenizer::from_file(path.string());
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

int32_t id(const Tokenizer& t, std::string_view token) {
  return t.require_id(token);
}

}  // namespace

TEST(Tokenizer, LoadsFixtureVocabularyAndSpecialTokens) {
  const Tokenizer& t = tiny();
  EXPECT_EQ(t.vocab_size(), 2045u);  // largest id is <|video|> = 2044
  EXPECT_EQ(t.token_to_id("<pad>"), 0);
  EXPECT_EQ(t.token_to_id("<eos>"), 1);
  EXPECT_EQ(t.token_to_id("<bos>"), 2);
  EXPECT_EQ(t.token_to_id("<unk>"), 3);
  EXPECT_EQ(t.token_to_id("<|turn>"), 105);
  EXPECT_EQ(t.token_to_id("<turn|>"), 106);
  EXPECT_EQ(t.token_to_id("<|image>"), 2000);
  EXPECT_EQ(t.token_to_id("<|image|>"), 2040);
  EXPECT_EQ(t.token_to_id("<image|>"), 2042);
  EXPECT_EQ(t.token_to_id("no such token"), std::nullopt);
  EXPECT_EQ(t.id_to_token(339), "\u2581the");
  EXPECT_EQ(t.id_to_token(4), "<0x00>");
  EXPECT_TRUE(t.is_special(105));
  EXPECT_FALSE(t.is_special(339));
  EXPECT_EQ(t.bos_id(), 2);
  EXPECT_EQ(t.eos_id(), 1);
  EXPECT_EQ(t.pad_id(), 0);
  EXPECT_EQ(t.unk_id(), 3);
  // tokenizer_config.json says add_bos_token false, add_eos_token false.
  EXPECT_TRUE(t.special_prefix().empty());
  EXPECT_TRUE(t.special_suffix().empty());
}

TEST(Tokenizer, AppliesMergesByRankNotPosition) {
  const Tokenizer& t = tiny();
  // " the": "▁ t" (rank 0), then "h e" (1), then "▁t he" (2) leaves a single token.
  EXPECT_EQ(t.encode(" the"), std::vector<int32_t>{id(t, "\u2581the")});
  // " sing": "i n" (rank 4) before "▁ s" (9), then "in g" (24).
  EXPECT_EQ(t.encode(" sing"), (std::vector<int32_t>{id(t, "\u2581s"), id(t, "ing")}));
  // No leading space is invented (no Prepend normalizer): "the" is "t" + "he".
  EXPECT_EQ(t.encode("the"), (std::vector<int32_t>{id(t, "t"), id(t, "he")}));
  EXPECT_EQ(t.encode(" and of"), (std::vector<int32_t>{id(t, "\u2581and"), id(t, "\u2581of")}));
  EXPECT_TRUE(t.encode("").empty());
}

TEST(Tokenizer, BreaksMergeTiesLeftmostFirst) {
  json j = fixture_json();
  j["model"]["vocab"]["xx"] = 1990;
  j["model"]["merges"].push_back("x x");
  const Tokenizer t = load_variant("ties", j);
  EXPECT_EQ(t.encode("xxx"), (std::vector<int32_t>{1990, id(t, "x")}));
  EXPECT_EQ(t.encode("xxxx"), (std::vector<int32_t>{1990, 1990}));
}

TEST(Tokenizer, AcceptsMergesAsPairs) {
  json j = fixture_json();
  json pairs = json::array();
  for (const auto& m : j["model"]["merges"]) {
    const std::string s = m.get<std::string>();
    const size_t space = s.find(' ');
    pairs.push_back({s.substr(0, space), s.substr(space + 1)});
  }
  j["model"]["merges"] = pairs;
  const Tokenizer t = load_variant("pairs", j);
  const std::string text = "the sing and of the cat is in the house";
  EXPECT_EQ(t.encode(text), tiny().encode(text));
}

TEST(Tokenizer, IgnoreMergesTakesWholeWordsFromTheVocabulary) {
  json j = fixture_json();
  // "▁ab" exists only as a vocabulary entry; no merge chain produces it.
  j["model"]["vocab"]["\u2581ab"] = 1991;
  const Tokenizer without = load_variant("no_ignore", j);
  EXPECT_NE(without.encode(" ab"), std::vector<int32_t>{1991});
  j["model"]["ignore_merges"] = true;
  const Tokenizer with = load_variant("ignore", j);
  EXPECT_EQ(with.encode(" ab"), std::vector<int32_t>{1991});
}

TEST(Tokenizer, FallsBackToBytesForCharactersOutsideTheVocabulary) {
  const Tokenizer& t = tiny();
  // U+00E9 is not in the fixture vocabulary: its UTF-8 bytes C3 A9 become <0xC3> <0xA9>.
  EXPECT_EQ(t.encode("\u00e9"), (std::vector<int32_t>{id(t, "<0xC3>"), id(t, "<0xA9>")}));
  // A four-byte emoji, between known characters.
  EXPECT_EQ(t.encode("a\U0001F600b"),
            (std::vector<int32_t>{id(t, "a"), id(t, "<0xF0>"), id(t, "<0x9F>"), id(t, "<0x98>"),
                                  id(t, "<0x80>"), id(t, "b")}));
}

TEST(Tokenizer, UsesUnkWithoutByteFallback) {
  json j = fixture_json();
  j["model"]["byte_fallback"] = false;
  const Tokenizer t = load_variant("unk", j);
  // fuse_unk is true in the fixture: consecutive unknown characters give one <unk>.
  EXPECT_EQ(t.encode("a\u00e9\u00e8b"), (std::vector<int32_t>{id(t, "a"), 3, id(t, "b")}));
  j["model"]["fuse_unk"] = false;
  const Tokenizer unfused = load_variant("unk_unfused", j);
  EXPECT_EQ(unfused.encode("a\u00e9\u00e8b"), (std::vector<int32_t>{id(t, "a"), 3, 3, id(t, "b")}));
}

TEST(Tokenizer, RoundTripsText) {
  const Tokenizer& t = tiny();
  for (const std::string text :
       {"the cat is in the house", "  two  spaces\tand a tab\nnewline",
        "caf\u00e9 \u65e5\u672c\u8a9e", "emoji \U0001F468\u200D\U0001F469\u200D\U0001F467 zwj",
        "<|turn>user\nHi<turn|>\n", "x"}) {
    EXPECT_EQ(t.decode(t.encode(text)), text) << text;
  }
}

TEST(Tokenizer, ParsesSpecialTokenStringsInText) {
  const Tokenizer& t = tiny();
  const std::vector<int32_t> ids = t.encode("<|turn>user\nthe<turn|>");
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), 105);
  EXPECT_EQ(ids.back(), 106);
  // Text around the marker is tokenized on its own: "user" + "\n" + "the".
  std::vector<int32_t> inner(ids.begin() + 1, ids.end() - 1);
  EXPECT_EQ(inner, t.encode("user\nthe"));
  // Longest match: "<|image|>" rather than "<|image>" followed by text.
  EXPECT_EQ(t.encode("<|image|><|image><image|>"), (std::vector<int32_t>{2040, 2000, 2042}));
  // With parse_special off, the marker is plain text.
  const std::vector<int32_t> plain = t.encode("<|turn>", false, false);
  EXPECT_GT(plain.size(), 1u);
  EXPECT_EQ(t.decode(plain), "<|turn>");
  // Strings that merely look like markers stay text.
  EXPECT_EQ(t.decode(t.encode("<|turn|> <turn>")), "<|turn|> <turn>");
  for (const int32_t i : t.encode("<|turn|> <turn>")) EXPECT_FALSE(t.is_special(i));
}

TEST(Tokenizer, HonoursAddedTokenFlags) {
  json j = fixture_json();
  auto add = [&](int id, const char* content, bool special, bool lstrip, bool rstrip,
                 bool single_word, bool normalized) {
    j["added_tokens"].push_back({{"id", id},
                                 {"content", content},
                                 {"special", special},
                                 {"lstrip", lstrip},
                                 {"rstrip", rstrip},
                                 {"single_word", single_word},
                                 {"normalized", normalized}});
  };
  add(2045, "<mask>", true, true, false, false, false);
  add(2046, "<r>", true, false, true, false, false);
  add(2047, "[X]", false, false, false, true, false);
  add(2048, "hello world", false, false, false, false, true);
  add(2049, "ab", false, false, false, false, false);
  add(2050, "abc", false, false, false, false, false);
  const Tokenizer t = load_variant("flags", j);
  const int32_t a = id(t, "a"), b = id(t, "b"), sp = id(t, "\u2581");

  // lstrip swallows the spaces before the token, rstrip the ones after.
  EXPECT_EQ(t.encode("a  <mask>b"), (std::vector<int32_t>{a, 2045, b}));
  EXPECT_EQ(t.encode("a<r>  b"), (std::vector<int32_t>{a, 2046, b}));
  EXPECT_EQ(t.encode("a <r>"), (std::vector<int32_t>{a, sp, 2046}));
  // single_word: only between non-word characters.
  EXPECT_EQ(t.encode("[X]"), std::vector<int32_t>{2047});
  EXPECT_EQ(t.encode(" [X] ")[1], 2047);
  for (const int32_t i : t.encode("a[X]b")) EXPECT_NE(i, 2047);
  // normalized: matched after " " became "▁".
  EXPECT_EQ(t.encode("hello world"), std::vector<int32_t>{2048});
  // Longest match first.
  EXPECT_EQ(t.encode("abcab"), (std::vector<int32_t>{2050, 2049}));
  // Non-special added tokens are still matched with parse_special off; special ones are not.
  EXPECT_EQ(t.encode("ab", false, false), std::vector<int32_t>{2049});
  for (const int32_t i : t.encode("<mask>", false, false)) EXPECT_NE(i, 2045);
  // Decoding skips only the special ones.
  EXPECT_EQ(t.decode(std::vector<int32_t>{a, 2045, 2049, b}, true), "aabb");
  EXPECT_EQ(t.decode(std::vector<int32_t>{a, 2045, 2049, b}), "a<mask>abb");
}

TEST(Tokenizer, AddsSpecialTokensPerPostProcessorOrConfig) {
  json j = fixture_json();
  j["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single",
       {{{"SpecialToken", {{"id", "<bos>"}, {"type_id", 0}}}},
        {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
        {{"SpecialToken", {{"id", "<eos>"}, {"type_id", 0}}}}}},
      {"special_tokens", {{"<bos>", {{"id", "<bos>"}, {"ids", {2}}, {"tokens", {"<bos>"}}}}}}};
  const fs::path dir = scratch_dir("post");
  write_file(dir / "tokenizer.json", j.dump());
  const Tokenizer plain = Tokenizer::from_file((dir / "tokenizer.json").string());
  EXPECT_EQ(plain.encode("a", true), (std::vector<int32_t>{2, id(plain, "a"), 1}));
  EXPECT_EQ(plain.encode("a", false), (std::vector<int32_t>{id(plain, "a")}));
  // tokenizer_config.json overrides it, as transformers does.
  write_file(dir / "tokenizer_config.json", R"({"add_bos_token": true, "add_eos_token": false})");
  const Tokenizer configured = Tokenizer::from_model_dir(dir.string());
  EXPECT_EQ(configured.encode("a", true), (std::vector<int32_t>{2, id(plain, "a")}));
  EXPECT_EQ(tiny().encode("a", true), (std::vector<int32_t>{id(plain, "a")}));
}

TEST(Tokenizer, ConfigAddsMissingAddedTokens) {
  const fs::path dir = scratch_dir("config_added");
  fs::copy_file(kTokenizerJson, dir / "tokenizer.json", fs::copy_options::overwrite_existing);
  write_file(dir / "tokenizer_config.json",
             R"({"added_tokens_decoder": {"2046": {"content": "<|extra|>", "special": true}},
                 "eos_token": {"content": "<turn|>"}})");
  const Tokenizer t = Tokenizer::from_model_dir(dir.string());
  EXPECT_EQ(t.encode("a<|extra|>"), (std::vector<int32_t>{id(t, "a"), 2046}));
  EXPECT_TRUE(t.is_special(2046));
  EXPECT_EQ(t.eos_id(), 106);
}

TEST(Tokenizer, DecodesByteFallbackAndSkipsSpecial) {
  const Tokenizer& t = tiny();
  const std::vector<int32_t> ids = {2, id(t, "\u2581the"), id(t, "<0xC3>"), id(t, "<0xA9>"), 106};
  EXPECT_EQ(t.decode(ids), "<bos> the\u00e9<turn|>");
  EXPECT_EQ(t.decode(ids, true), " the\u00e9");
  // An ill-formed byte run decodes to one U+FFFD per byte, as HF does.
  EXPECT_EQ(t.decode(std::vector<int32_t>{id(t, "<0xC3>"), id(t, "a")}), "\uFFFDa");
  EXPECT_EQ(t.decode(std::vector<int32_t>{id(t, "<0xE6>"), id(t, "<0x97>")}), "\uFFFD\uFFFD");
}

TEST(Tokenizer, StripDecoderRemovesTheLeadingSpace) {
  json j = fixture_json();
  j["decoder"]["decoders"].push_back(
      {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
  const Tokenizer t = load_variant("strip", j);
  EXPECT_EQ(t.decode(t.encode(" the cat")), "the cat");
  StreamDecoder stream(t);
  std::string streamed;
  for (const int32_t i : t.encode(" the cat is in")) streamed += stream.push(i);
  streamed += stream.flush();
  EXPECT_EQ(streamed, "the cat is in");
}

TEST(StreamDecoder, NeverEmitsPartialUtf8) {
  const Tokenizer& t = tiny();
  // Every non-ASCII character here is byte fallback in the fixture, so each one is split over
  // two to four ids.
  const std::string text = "the \u00e9t\u00e9 \u65e5\u672c \U0001F600! <|turn>ok\u00ff";
  const std::vector<int32_t> ids = t.encode(text);
  ASSERT_GT(ids.size(), text.size() / 2);
  StreamDecoder stream(t);
  std::string streamed;
  size_t empty_pushes = 0;
  for (const int32_t i : ids) {
    const std::string piece = stream.push(i);
    EXPECT_EQ(utf8::find_invalid(piece), std::string::npos) << "partial UTF-8 emitted";
    EXPECT_EQ(piece.find("\uFFFD"), std::string::npos);
    if (piece.empty()) ++empty_pushes;
    streamed += piece;
  }
  streamed += stream.flush();
  EXPECT_EQ(streamed, t.decode(ids));
  EXPECT_EQ(streamed, text);
  EXPECT_GT(empty_pushes, 5u);  // the leading bytes of each sequence were held back
}

TEST(StreamDecoder, HoldsBackThenFlushesUnfinishedBytes) {
  const Tokenizer& t = tiny();
  StreamDecoder stream(t);
  EXPECT_EQ(stream.push(id(t, "a")), "a");
  EXPECT_EQ(stream.push(id(t, "<0xE6>")), "");
  EXPECT_EQ(stream.push(id(t, "<0x97>")), "");
  EXPECT_EQ(stream.push(id(t, "<0xA5>")), "\u65e5");
  EXPECT_EQ(stream.push(id(t, "<0xE6>")), "");
  EXPECT_EQ(stream.flush(), "\uFFFD");      // the stream ended inside a character
  EXPECT_EQ(stream.push(id(t, "b")), "b");  // flush reset the decoder
  StreamDecoder skipping(t, true);
  EXPECT_EQ(skipping.push(105), "");
  EXPECT_EQ(skipping.push(id(t, "\u2581the")), " the");
  EXPECT_THROW(skipping.push(5000), Error);
}

TEST(Tokenizer, RejectsInvalidUtf8Input) {
  const Tokenizer& t = tiny();
  for (const std::string& bad : {std::string("ab\xC3"), std::string("\xFF"),
                                 std::string("\xED\xA0\x80"),  // a UTF-16 surrogate
                                 std::string("\xC0\xAF")}) {   // overlong '/'
    const std::string msg = message_of([&] { t.encode(bad); });
    EXPECT_NE(msg.find("not valid UTF-8"), std::string::npos) << msg;
  }
}

TEST(Tokenizer, RejectsIdsOutsideTheVocabulary) {
  const Tokenizer& t = tiny();
  EXPECT_NE(message_of([&] {
              t.decode(std::vector<int32_t>{1, 99999});
            }).find("99999"),
            std::string::npos);
  EXPECT_THROW(t.decode(std::vector<int32_t>{-1}), Error);
  EXPECT_THROW(t.id_to_token(2043), Error);  // a hole between the added tokens
  EXPECT_NE(message_of([&] { t.require_id("<|think|>"); }).find("<|think|>"), std::string::npos);
}

TEST(Tokenizer, RejectsBadFilesWithClearErrors) {
  const fs::path dir = scratch_dir("bad");
  const auto load_text = [&](const std::string& text) {
    write_file(dir / "tokenizer.json", text);
    return message_of([&] { Tokenizer::from_file((dir / "tokenizer.json").string()); });
  };
  EXPECT_NE(load_text("this is not json").find("not valid JSON"), std::string::npos);
  EXPECT_NE(load_text("[1, 2]").find("not a JSON object"), std::string::npos);
  EXPECT_NE(load_text(R"({"version": "1.0"})").find("missing \"model\""), std::string::npos);

  json j = fixture_json();
  j["model"]["type"] = "WordPiece";
  EXPECT_NE(load_text(j.dump()).find("model.type is \"WordPiece\""), std::string::npos);
  j = fixture_json();
  j["model"].erase("vocab");
  EXPECT_NE(load_text(j.dump()).find("model.vocab is missing"), std::string::npos);
  j = fixture_json();
  j["model"]["merges"].push_back("zz qq");
  EXPECT_NE(load_text(j.dump()).find("not in model.vocab"), std::string::npos);
  j = fixture_json();
  j["normalizer"] = {{"type", "Lowercase"}};
  EXPECT_NE(load_text(j.dump()).find("normalizer type \"Lowercase\""), std::string::npos);
  j = fixture_json();
  j["pre_tokenizer"] = {{"type", "ByteLevel"}};
  EXPECT_NE(load_text(j.dump()).find("pre_tokenizer type \"ByteLevel\""), std::string::npos);
  j = fixture_json();
  j["decoder"] = {{"type", "Metaspace"}};
  EXPECT_NE(load_text(j.dump()).find("decoder type \"Metaspace\""), std::string::npos);
  EXPECT_NE(message_of([&] { Tokenizer::from_file((dir / "missing.json").string()); }),
            "(no error)");
  EXPECT_NE(message_of([&] {
              Tokenizer::from_model_dir(dir.string() + "/nowhere");
            }).find("no tokenizer.json"),
            std::string::npos);
}

TEST(Tokenizer, NormalizerSequenceWithPrependAndTrivialNfc) {
  json j = fixture_json();
  j["normalizer"] = {
      {"type", "Sequence"},
      {"normalizers",
       {{{"type", "NFC"}},
        {{"type", "Prepend"}, {"prepend", "\u2581"}},
        {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}}}};
  const Tokenizer t = load_variant("prepend", j);
  EXPECT_EQ(t.encode("the"), std::vector<int32_t>{id(t, "\u2581the")});
  EXPECT_NE(message_of([&] { t.encode("e\u0301"); }).find("NFC"), std::string::npos);
}

TEST(Tokenizer, SplitPreTokenizerKeepsBpeInsideEachPiece) {
  json j = fixture_json();
  // Isolating "h" stops "▁t he" from ever forming.
  j["pre_tokenizer"] = {{"type", "Split"},
                        {"pattern", {{"String", "h"}}},
                        {"behavior", "Isolated"},
                        {"invert", false}};
  const Tokenizer t = load_variant("split", j);
  EXPECT_EQ(t.encode(" the"), (std::vector<int32_t>{id(t, "\u2581t"), id(t, "h"), id(t, "e")}));
  j["pre_tokenizer"]["behavior"] = "MergedWithNext";
  const Tokenizer next = load_variant("split_next", j);
  EXPECT_EQ(next.encode(" the"), (std::vector<int32_t>{id(t, "\u2581t"), id(t, "he")}));
}

namespace {
std::string run_cli(const std::string& args) {
  const std::string cmd = std::string(GEMSTAGE_CLI) + " " + args + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return "(popen failed)";
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), pipe)) > 0;) out.append(buf, n);
  pclose(pipe);
  return out;
}
}  // namespace

TEST(TokenizerCli, TokenizeAndDetokenizeAgreeWithTheLibrary) {
  const Tokenizer& t = tiny();
  const fs::path dir = scratch_dir("cli");
  const std::string text = "the cat <|turn>user\n\u00e9";
  write_file(dir / "text.txt", text);
  const std::string out = run_cli("tokenize --model " + kModelDir + " --text-file " +
                                  (dir / "text.txt").string() + " --json");
  EXPECT_EQ(json::parse(out).get<std::vector<int32_t>>(), t.encode(text));

  const std::string spaced =
      run_cli("tokenize --tokenizer " + kTokenizerJson + " --text 'the cat'");
  std::string expected;
  for (const int32_t i : t.encode("the cat")) {
    if (!expected.empty()) expected.push_back(' ');
    expected.append(std::to_string(i));
  }
  EXPECT_EQ(spaced, expected + "\n");

  write_file(dir / "ids.json", json(t.encode(text)).dump());
  EXPECT_EQ(
      run_cli("detokenize --model " + kModelDir + " --ids-file " + (dir / "ids.json").string()),
      text);
  EXPECT_EQ(run_cli("detokenize --tokenizer " + kTokenizerJson + " --ids '105 339' --skip-special"),
            " the");
  EXPECT_NE(
      run_cli("detokenize --tokenizer " + kTokenizerJson + " --ids '1 x'").find("not a token id"),
      std::string::npos);
}
