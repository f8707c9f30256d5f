#include "gemma4/model.h"

#include "gemma4/registry.h"

namespace gemstage {

std::unique_ptr<Gemma4Model> Gemma4Model::open(const std::string& dir) {
  std::unique_ptr<Gemma4Model> m(new Gemma4Model());
  m->dir_ = dir;
  m->config_ = load_model_config(dir);
  m->store_ = TensorStore::open_dir(dir);
  std::vector<TensorSpec> specs = text_tensor_specs(m->config_);
  const std::vector<TensorSpec> vision = vision_tensor_specs(m->config_);
  specs.insert(specs.end(), vision.begin(), vision.end());
  const std::vector<std::string> unknown = validate_tensors(specs, m->store_, m->config_);
  m->notes_ = m->config_.warnings;
  for (const auto& k : unknown)
    m->notes_.push_back("tensor " + k + " is not used by gemstage; ignored");
  m->text_ = std::make_unique<TextModel>(m->config_, bind_text_weights(m->config_, m->store_));
  if (m->config_.vision)
    m->vision_ =
        std::make_unique<VisionTower>(m->config_, bind_vision_weights(m->config_, m->store_));
  return m;
}

}  // namespace gemstage
