// Hugging Face tokenizer.json reader and BPE tokenizer, restricted to what Gemma's files declare
// (Replace/Prepend normalizers, Split pre-tokenizer, byte-fallback BPE, Replace/ByteFallback/Fuse/
// Strip decoders). Anything else is refused at load time rather than tokenized differently.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace gemstage {

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool special = false;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
};

struct TokenizerImpl;

class Tokenizer {
 public:
  // tokenizer.json alone: BOS/EOS insertion for add_special comes from its post_processor.
  static Tokenizer from_file(const std::string& tokenizer_json_path);
  // <dir>/tokenizer.json plus, when present, <dir>/tokenizer_config.json, whose add_bos_token /
  // add_eos_token override the post_processor (as transformers does) and whose bos/eos/pad/unk
  // names and added_tokens_decoder entries are honoured.
  static Tokenizer from_model_dir(const std::string& dir);

  // Encodes like HF `encode`: added tokens found in the text (special ones too, unless
  // parse_special is false) become their ids; add_special inserts the BOS/EOS the post processor
  // or tokenizer_config asks for. Throws gemstage::Error on invalid UTF-8.
  std::vector<int32_t> encode(std::string_view text, bool add_special = false,
                              bool parse_special = true) const;
  // Decodes through the decoder chain; skip_special drops tokens flagged special.
  // Throws on ids outside the vocabulary.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // Like token_to_id, but a missing token is an error naming the token and the file.
  int32_t require_id(std::string_view token) const;
  // Throws on an id that names no token.
  const std::string& id_to_token(int32_t id) const;
  // The bytes one token adds to decoded text, through the decoder's Replace steps, with a
  // byte-fallback token as its single raw byte (possibly part of a UTF-8 sequence) and a special
  // token as its content. Strip steps, which act only at the ends of a whole text, are left out.
  // For constrained decoding, which must match text a token at a time.
  std::string token_bytes(int32_t id) const;
  // Whether an id names a token (a model's vocabulary may be larger than its tokenizer's).
  bool has_id(int32_t id) const;
  bool is_special(int32_t id) const;
  // One more than the largest id in the vocabulary or the added tokens.
  size_t vocab_size() const;

  const std::vector<AddedToken>& added_tokens() const;
  // Ids of the tokens tokenizer_config.json (or the conventional Gemma names) designates.
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  std::optional<int32_t> pad_id() const;
  std::optional<int32_t> unk_id() const;
  // What encode(..., add_special=true) puts before and after the text.
  const std::vector<int32_t>& special_prefix() const;
  const std::vector<int32_t>& special_suffix() const;
  const std::string& source_path() const;

 private:
  explicit Tokenizer(std::shared_ptr<TokenizerImpl> impl) : impl_(std::move(impl)) {}
  // Shared so that copies (one per server request, say) are cheap; the model is immutable.
  std::shared_ptr<TokenizerImpl> impl_;
  friend class StreamDecoder;
};

// Incremental detokenizer for streaming output. Each push returns the text that became final
// with that id (possibly empty); it never returns a partial UTF-8 sequence. The concatenation of
// all pushes plus flush() equals decode() of the whole id sequence, except where the ids hold an
// ill-formed byte-fallback run right after text that was already emitted (that text stands; the
// new bytes decode to U+FFFD on their own).
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special = false);
  std::string push(int32_t id);
  // Whatever is still held back (an unfinished byte sequence decodes to U+FFFD here).
  std::string flush();
  void reset();

 private:
  std::string pending_text() const;

  Tokenizer tokenizer_;
  bool skip_special_;
  // ids_[0, read_begin_) were emitted by the last successful push; they are decoded again as
  // context so that decoders which look at the start of the text (Strip) act as in a full decode.
  std::vector<int32_t> ids_;
  size_t read_begin_ = 0;
};

}  // namespace gemstage
