#include "gemma4/multimodal.h"

#include <algorithm>

#include "core/error.h"

namespace gemstage {

int64_t count_placeholders(const ModelConfig& c, std::span<const int32_t> input_ids) {
  const std::vector<int> ph = c.placeholder_token_ids();
  int64_t n = 0;
  for (int32_t id : input_ids) n += std::find(ph.begin(), ph.end(), id) != ph.end() ? 1 : 0;
  return n;
}

namespace {

bool is_vision_placeholder(const ModelConfig& c, int32_t id) {
  return id == c.image_token_id || id == c.video_token_id;
}

}  // namespace

std::vector<int32_t> vision_groups(const ModelConfig& c, std::span<const int32_t> input_ids,
                                   int32_t first_group) {
  std::vector<int32_t> g(input_ids.size(), -1);
  int32_t next = first_group;
  for (size_t r = 0; r < input_ids.size(); ++r) {
    if (!is_vision_placeholder(c, input_ids[r])) continue;
    if (r > 0 && g[r - 1] >= 0)
      g[r] = g[r - 1];
    else
      g[r] = next++;
  }
  return g;
}

int64_t chunk_end_keeping_images_whole(const ModelConfig& c, std::span<const int32_t> input_ids,
                                       int64_t begin, int64_t end) {
  const int64_t S = static_cast<int64_t>(input_ids.size());
  if (!c.text.bidirectional_vision || end <= begin || end >= S) return std::min(end, S);
  auto vision = [&](int64_t r) {
    return is_vision_placeholder(c, input_ids[static_cast<size_t>(r)]);
  };
  if (!vision(end) || !vision(end - 1)) return end;  // the boundary is not inside a run
  int64_t run_begin = end - 1;
  while (run_begin > begin && vision(run_begin - 1)) --run_begin;
  if (run_begin > begin) return run_begin;  // end the chunk before the image
  int64_t run_end = end;                    // the image starts the chunk: take all of it
  while (run_end < S && vision(run_end)) ++run_end;
  return run_end;
}

FloatTensor merge_soft_tokens(const ModelConfig& c, std::span<const int32_t> input_ids,
                              const FloatTensor* vision_soft, const FloatTensor* audio_soft) {
  if (!vision_soft && !audio_soft) return {};
  if (!audio_soft) return *vision_soft;
  int64_t n_audio = 0, n_vision = 0;
  for (int32_t id : input_ids) {
    if (id == c.audio_token_id) ++n_audio;
    if (id == c.image_token_id || id == c.video_token_id) ++n_vision;
  }
  const int64_t nv = vision_soft ? vision_soft->dim(0) : 0, na = audio_soft->dim(0);
  if (na != n_audio)
    fail("the prompt has ", n_audio, " audio placeholder tokens (audio_token_id ", c.audio_token_id,
         ") but the audio yields ", na, " soft tokens");
  if (vision_soft && nv != n_vision)
    fail("the prompt has ", n_vision, " image/video placeholder tokens but the images yield ", nv,
         " soft tokens");
  if (!vision_soft && n_vision)
    fail("the prompt has ", n_vision, " image/video placeholder tokens but no image was given");
  const int64_t D = audio_soft->dim(1);
  FloatTensor out({nv + na, D});
  int64_t vi = 0, ai = 0, k = 0;
  for (int32_t id : input_ids) {
    if (id == c.audio_token_id)
      std::copy_n(audio_soft->row(ai++), D, out.row(k++));
    else if (id == c.image_token_id || id == c.video_token_id)
      std::copy_n(vision_soft->row(vi++), D, out.row(k++));
  }
  return out;
}

FloatTensor slice_rows(const FloatTensor& t, int64_t begin, int64_t n) {
  if (t.shape.size() != 2 || begin < 0 || n < 0 || begin + n > t.dim(0))
    fail("slice_rows: rows [", begin, ", ", begin + n, ") are outside a tensor of shape ",
         shape_str(t.shape));
  FloatTensor out({n, t.dim(1)});
  std::copy(t.row(begin), t.row(begin) + n * t.dim(1), out.data.begin());
  return out;
}

FloatTensor prefill_chunks(const ModelConfig& c, std::span<const int32_t> input_ids,
                           const FloatTensor* soft_tokens, int64_t chunk,
                           const ChunkForward& forward) {
  const int64_t S = static_cast<int64_t>(input_ids.size());
  if (S == 0) fail("prefill: the prompt is empty");
  const int64_t n_ph = count_placeholders(c, input_ids);
  const int64_t n_soft = soft_tokens ? soft_tokens->dim(0) : 0;
  if (n_ph != n_soft)
    fail("the prompt has ", n_ph, " image/audio/video placeholder tokens but the images yield ",
         n_soft, " soft tokens; each image needs exactly as many placeholders (image_token_id ",
         c.image_token_id, ") as it yields soft tokens");
  if (chunk <= 0 || chunk > S) chunk = S;
  FloatTensor last;
  int64_t used = 0;  // soft tokens consumed by earlier chunks
  for (int64_t b = 0, n = 0; b < S; b += n) {
    // On the large models a chunk never splits an image: its rows see each other on sliding
    // layers, which a cache filled chunk by chunk cannot give.
    n = chunk_end_keeping_images_whole(c, input_ids, b, std::min(b + chunk, S)) - b;
    const auto ids = input_ids.subspan(static_cast<size_t>(b), static_cast<size_t>(n));
    const int64_t k = count_placeholders(c, ids);
    FloatTensor part;
    if (k) part = slice_rows(*soft_tokens, used, k);
    used += k;
    last = forward(ids, k ? &part : nullptr);
  }
  return last;
}

}  // namespace gemstage
