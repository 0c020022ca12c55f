// deploykit::SaPE2Distance and deploykit::SaPE2Signatures for OpenVINO: an extension library (ops
// with `evaluate`, and their mapping from the ONNX frontend), running the kernels of
// sape2_distance.c on threads of their own:
// OpenVINO gives an op's evaluate no thread pool. Its `threads` attribute is the runner's share of
// the cores (deploykit.backends.openvino sets it), 0 all of them. An optional third input, the
// attention logits [B, h, T, T], is added as the distances are written (the ONNX Runtime op's form).
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/frontend/onnx/extension/op.hpp>
#include <openvino/op/op.hpp>

extern "C" int deploykit_sape2_signatures_threads(const float *q, const float *k, const float *ex, const float *ey, int64_t bh, int64_t d,
                                                  int64_t m, int64_t grid_h, int64_t grid_w, int64_t p, float scale, int64_t mode, float *zx,
                                                  float *zy, int threads);
extern "C" int deploykit_sape2_distance_add_threads(const float *zx, const float *zy, const float *add, int64_t bh, int64_t n, int64_t w,
                                                    int64_t h, int64_t p, float *out, int threads);

namespace deploykit {

class SaPE2Distance : public ov::op::Op {
 public:
  OPENVINO_OP("SaPE2Distance", "deploykit");

  SaPE2Distance() = default;
  SaPE2Distance(const ov::OutputVector &args) : Op(args) { constructor_validate_and_infer_types(); }

  void validate_and_infer_types() override {
    const auto zx = get_input_partial_shape(0);
    ov::PartialShape out = ov::PartialShape::dynamic(4);
    if (zx.rank().is_static() && zx.rank().get_length() == 4) {
      const auto tokens = m_prefix + m_grid_h * m_grid_w;
      out = ov::PartialShape{zx[0], zx[1], tokens, tokens};
    }
    set_output_type(0, ov::element::f32, out);
  }

  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector &args) const override {
    auto copy = std::make_shared<SaPE2Distance>(args);
    copy->m_grid_h = m_grid_h;
    copy->m_grid_w = m_grid_w;
    copy->m_prefix = m_prefix;
    copy->m_threads = m_threads;
    copy->validate_and_infer_types();
    return copy;
  }

  bool visit_attributes(ov::AttributeVisitor &visitor) override {
    visitor.on_attribute("grid_h", m_grid_h);
    visitor.on_attribute("grid_w", m_grid_w);
    visitor.on_attribute("num_prefix_tokens", m_prefix);
    visitor.on_attribute("threads", m_threads);
    return true;
  }

  bool has_evaluate() const override { return true; }

  bool evaluate(ov::TensorVector &outputs, const ov::TensorVector &inputs) const override {
    const auto sx = inputs[0].get_shape(), sy = inputs[1].get_shape();
    const int64_t n = m_grid_h * m_grid_w, t = m_prefix + n;
    if (sx.size() != 4 || sy.size() != 4 || sx[0] != sy[0] || sx[1] != sy[1] || int64_t(sx[2]) != n || int64_t(sy[2]) != n ||
        int64_t(sx[3]) != m_grid_w || int64_t(sy[3]) != m_grid_h || inputs[0].get_element_type() != ov::element::f32 ||
        inputs[1].get_element_type() != ov::element::f32)
      return false;
    const float *add = nullptr;
    if (inputs.size() == 3) {
      if (inputs[2].get_shape() != ov::Shape{sx[0], sx[1], size_t(t), size_t(t)} || inputs[2].get_element_type() != ov::element::f32)
        return false;
      add = inputs[2].data<const float>();
    }
    outputs[0].set_shape(ov::Shape{sx[0], sx[1], size_t(t), size_t(t)});
    const unsigned cores = std::thread::hardware_concurrency();
    const int threads = m_threads > 0 ? int(m_threads) : cores ? int(cores) : 1;
    return deploykit_sape2_distance_add_threads(inputs[0].data<const float>(), inputs[1].data<const float>(), add, int64_t(sx[0] * sx[1]),
                                                n, m_grid_w, m_grid_h, m_prefix, outputs[0].data<float>(), threads) == 0;
  }

 private:
  int64_t m_grid_h = 1, m_grid_w = 1, m_prefix = 0;
  int64_t m_threads = 0;  // the runner's share of the cores; 0: all of them
};

// Zx [B, h, N, W] and Zy [B, h, N, H] from q, k [B, h, P + N, d] and the tables [d, M] (fp32).
class SaPE2Signatures : public ov::op::Op {
 public:
  OPENVINO_OP("SaPE2Signatures", "deploykit");

  SaPE2Signatures() = default;
  SaPE2Signatures(const ov::OutputVector &args) : Op(args) { constructor_validate_and_infer_types(); }

  void validate_and_infer_types() override {
    const auto q = get_input_partial_shape(0);
    ov::PartialShape zx = ov::PartialShape::dynamic(4), zy = ov::PartialShape::dynamic(4);
    if (q.rank().is_static() && q.rank().get_length() == 4) {
      zx = ov::PartialShape{q[0], q[1], m_grid_h * m_grid_w, m_grid_w};
      zy = ov::PartialShape{q[0], q[1], m_grid_h * m_grid_w, m_grid_h};
    }
    set_output_type(0, ov::element::f32, zx);
    set_output_type(1, ov::element::f32, zy);
  }

  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector &args) const override {
    auto copy = std::make_shared<SaPE2Signatures>(args);
    copy->m_grid_h = m_grid_h;
    copy->m_grid_w = m_grid_w;
    copy->m_prefix = m_prefix;
    copy->m_mode = m_mode;
    copy->m_scale = m_scale;
    copy->m_threads = m_threads;
    copy->validate_and_infer_types();
    return copy;
  }

  bool visit_attributes(ov::AttributeVisitor &visitor) override {
    visitor.on_attribute("grid_h", m_grid_h);
    visitor.on_attribute("grid_w", m_grid_w);
    visitor.on_attribute("num_prefix_tokens", m_prefix);
    visitor.on_attribute("mode", m_mode);
    visitor.on_attribute("scale", m_scale);
    visitor.on_attribute("threads", m_threads);
    return true;
  }

  bool has_evaluate() const override { return true; }

  bool evaluate(ov::TensorVector &outputs, const ov::TensorVector &inputs) const override {
    const auto sq = inputs[0].get_shape(), sx = inputs[2].get_shape();
    const int64_t n = m_grid_h * m_grid_w;
    for (const auto &input : inputs)
      if (input.get_element_type() != ov::element::f32) return false;
    if (sq.size() != 4 || inputs[1].get_shape() != sq || int64_t(sq[2]) != m_prefix + n || sx.size() != 2 || sx[0] != sq[3] ||
        inputs[3].get_shape() != sx || sx[1] < 1 || m_mode < 0 || m_mode > 2)
      return false;
    outputs[0].set_shape(ov::Shape{sq[0], sq[1], size_t(n), size_t(m_grid_w)});
    outputs[1].set_shape(ov::Shape{sq[0], sq[1], size_t(n), size_t(m_grid_h)});
    const unsigned cores = std::thread::hardware_concurrency();
    const int threads = m_threads > 0 ? int(m_threads) : cores ? int(cores) : 1;
    return deploykit_sape2_signatures_threads(inputs[0].data<const float>(), inputs[1].data<const float>(), inputs[2].data<const float>(),
                                              inputs[3].data<const float>(), int64_t(sq[0] * sq[1]), int64_t(sq[3]), int64_t(sx[1]),
                                              m_grid_h, m_grid_w, m_prefix, m_scale, m_mode, outputs[0].data<float>(),
                                              outputs[1].data<float>(), threads) == 0;
  }

 private:
  int64_t m_grid_h = 1, m_grid_w = 1, m_prefix = 0, m_mode = 1;
  float m_scale = 1.f;
  int64_t m_threads = 0;  // the runner's share of the cores; 0: all of them
};

}  // namespace deploykit

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({
    std::make_shared<ov::OpExtension<deploykit::SaPE2Distance>>(),
    std::make_shared<ov::frontend::onnx::OpExtension<deploykit::SaPE2Distance>>("SaPE2Distance", "deploykit",
                                                                                  std::map<std::string, std::string>{}),
    std::make_shared<ov::OpExtension<deploykit::SaPE2Signatures>>(),
    std::make_shared<ov::frontend::onnx::OpExtension<deploykit::SaPE2Signatures>>("SaPE2Signatures", "deploykit",
                                                                                    std::map<std::string, std::string>{}),
}));
