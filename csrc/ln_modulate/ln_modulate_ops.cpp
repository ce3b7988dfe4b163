// Dispatcher registration of the fused LayerNorm-Modulate op: schemas, argument checks, the
// public composite entry point, autograd (a hand-written autograd node), the CPU implementation
// (the kernels' math in ATen, fp64 stays fp64 for gradcheck) and the Meta implementations
// (FakeTensor / torch.compile, symbolic shapes). No CUDA here: this file also builds on its own
// as a CPU-only library (ds_adaptive.ops.builder.build_cpu_ops), which the CPU tests load; the
// CUDA implementations are registered by ln_modulate_torch.cpp in the full extension.
//
//   ds_adaptive::ln_modulate_apply(x, shift, scale, eps, weight?, bias?) -> y
//       what ds_adaptive.ops.ln_modulate calls: checks (ValueError / TypeError naming the expected
//       and actual shapes), layout normalisation (2-D modulation -> [B, 1, D], one modulation
//       dtype, broadcast dims as stride-0 expands, fp32 affine parameters), then ln_modulate.
//   ds_adaptive::ln_modulate(x, shift, scale, weight?, bias?, eps) -> (y, mean, rstd)
//   ds_adaptive::ln_modulate_backward(dy, x, mean, rstd, scale, weight?, bias?, need_dshift)
//       -> (dx, dshift, dscale, dweight, dbias)
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

namespace {

using at::Tensor;
using std::optional;
using FwdOut = std::tuple<Tensor, Tensor, Tensor>;
using BwdOut = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

// Statistics dtype: fp32 for the kernels' dtypes, fp64 for fp64 x (CPU implementation, gradcheck).
at::ScalarType stats_dtype(const Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// Sizes and sizes in error messages, concrete values printed as integers ("[2, 5, 64]", the format of
// c10's ArrayRef printing). Printing c10::SymInt / SymIntArrayRef through c10::str in these messages
// segfaulted in the CUDA extension under torch 2.11 on the H200 whenever such a check failed
// (a one-off check, bench/ln_modulate_cpp_errors.py at c0c9b33: the shape messages crashed, the device / dtype
// messages of the same checks raised cleanly); these helpers never call SymInt's operator<<.
std::string sym_str(const c10::SymInt& v) {
  const auto c = v.maybe_as_int();
  return c.has_value() ? std::to_string(*c) : std::string("<symbolic>");
}

std::string sizes_str(c10::SymIntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + sym_str(sizes[i]);
  return out + "]";
}

// ------------------------------------------------------------------------------------------------
// Checks of the public entry point: the messages of the Python reference path
// (ds_adaptive/ops/ln_modulate.py: _check_args), ValueError for shapes / devices, TypeError for dtypes.
// ------------------------------------------------------------------------------------------------
void check_apply_args(const Tensor& x, const Tensor& shift, const Tensor& scale, const optional<Tensor>& weight,
                      const optional<Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() == 3, "ln_modulate: x must be a [B, S, D] tensor, got ", sizes_str(x.sym_sizes()));
  TORCH_CHECK_TYPE(x.is_floating_point(), "ln_modulate: x must be a floating-point tensor, got ", x.scalar_type());
  const c10::SymInt& B = x.sym_size(0);
  const c10::SymInt& S = x.sym_size(1);
  const c10::SymInt& D = x.sym_size(2);
  for (const auto& [name, m] : {std::pair<const char*, const Tensor&>{"shift", shift}, {"scale", scale}}) {
    const bool ok = (m.dim() == 2 && (m.sym_size(0) == 1 || m.sym_size(0) == B) && m.sym_size(1) == D) ||
                    (m.dim() == 3 && (m.sym_size(0) == 1 || m.sym_size(0) == B) &&
                     (m.sym_size(1) == 1 || m.sym_size(1) == S) && m.sym_size(2) == D);
    TORCH_CHECK_VALUE(ok, "ln_modulate: ", name, " must be [B, D], [B, 1, D] or [B, S, D] with B = ", sym_str(B),
                      ", S = ", sym_str(S), ", D = ", sym_str(D), " (B may be 1), got ", sizes_str(m.sym_sizes()));
    TORCH_CHECK_TYPE(m.is_floating_point(), "ln_modulate: ", name, " must be floating point, got ", m.scalar_type());
    TORCH_CHECK_VALUE(m.device() == x.device(), "ln_modulate: ", name, " is on ", m.device(), " but x is on ",
                      x.device());
  }
  for (const auto& [name, p] : {std::pair<const char*, const optional<Tensor>&>{"weight", weight}, {"bias", bias}}) {
    if (!p.has_value()) continue;
    TORCH_CHECK_VALUE(p->dim() == 1 && p->sym_size(0) == D, "ln_modulate: ", name, " must be a [D] = [",
                      sym_str(D), "] tensor or None, got ", sizes_str(p->sym_sizes()));
    TORCH_CHECK_VALUE(p->device() == x.device(), "ln_modulate: ", name, " is on ", p->device(), " but x is on ",
                      x.device());
  }
}

// Checks of the raw op (any backend): what every implementation relies on.
void check_op_args(const Tensor& x, const Tensor& shift, const Tensor& scale, const optional<Tensor>& weight,
                   const optional<Tensor>& bias) {
  TORCH_CHECK(x.dim() == 3, "ln_modulate: x must be [B, S, D], got shape ", sizes_str(x.sym_sizes()));
  for (const auto& [name, m] : {std::pair<const char*, const Tensor&>{"shift", shift}, {"scale", scale}}) {
    TORCH_CHECK(m.device() == x.device(), "ln_modulate: ", name, " is on ", m.device(), " but x is on ", x.device());
    TORCH_CHECK(m.dim() == 3 && m.sym_size(0) == x.sym_size(0) &&
                    (m.sym_size(1) == 1 || m.sym_size(1) == x.sym_size(1)) && m.sym_size(2) == x.sym_size(2),
                "ln_modulate: ", name, " must be [B, 1, D] or [B, S, D] = [", sym_str(x.sym_size(0)), ", 1 or ",
                sym_str(x.sym_size(1)), ", ", sym_str(x.sym_size(2)), "], got ", sizes_str(m.sym_sizes()));
    TORCH_CHECK(m.scalar_type() == at::kFloat || m.scalar_type() == x.scalar_type(), "ln_modulate: ", name,
                " must be float32 or x's dtype (", x.scalar_type(), "), got ", m.scalar_type());
  }
  TORCH_CHECK(shift.scalar_type() == scale.scalar_type(), "ln_modulate: shift and scale must share a dtype, got ",
              shift.scalar_type(), " and ", scale.scalar_type());
  for (const auto& [name, p] : {std::pair<const char*, const optional<Tensor>&>{"weight", weight}, {"bias", bias}}) {
    if (!p.has_value()) continue;
    TORCH_CHECK(p->device() == x.device(), "ln_modulate: ", name, " is on ", p->device(), " but x is on ", x.device());
    TORCH_CHECK(p->dim() == 1 && p->sym_size(0) == x.sym_size(2), "ln_modulate: ", name, " must be [D = ",
                sym_str(x.sym_size(2)), "], got ", sizes_str(p->sym_sizes()));
  }
}

// ------------------------------------------------------------------------------------------------
// Op handles (typed, looked up once)
// ------------------------------------------------------------------------------------------------
const c10::TypedOperatorHandle<FwdOut(const Tensor&, const Tensor&, const Tensor&, const optional<Tensor>&,
                                      const optional<Tensor>&, double)>&
fwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("ds_adaptive::ln_modulate", "")
                             .typed<FwdOut(const Tensor&, const Tensor&, const Tensor&, const optional<Tensor>&,
                                           const optional<Tensor>&, double)>();
  return op;
}

const c10::TypedOperatorHandle<BwdOut(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                      const optional<Tensor>&, const optional<Tensor>&, bool)>&
bwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("ds_adaptive::ln_modulate_backward", "")
                             .typed<BwdOut(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                           const optional<Tensor>&, const optional<Tensor>&, bool)>();
  return op;
}

// ------------------------------------------------------------------------------------------------
// Autograd: a hand-written node (what torch's generated VariableType code does for native ops), not
// a torch::autograd::Function. Issue 18, host time per call: the custom Function made mean / rstd
// outputs of the autograd graph (wrapped, marked non-differentiable, given undefined gradients by the
// engine) and paid CppNode's generic bookkeeping per call (output wrapping, saved-variable list,
// ctx->saved_data map, per-output checks in the backward). Here y is the node's only input; mean / rstd
// are plain tensors saved inside the node; saves x, mean, rstd, scale, weight, bias (not y, not shift).
// Per-token dshift *is* dy: returned as dy itself when the dtypes agree (no kernel write), written by
// the backward otherwise.
// ------------------------------------------------------------------------------------------------
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
// Node pointers are std::shared_ptr<Node> up to torch 2.11 (deleted through torch::autograd::deleteNode)
// and c10::intrusive_ptr<Node> in later versions: take the type from Edge and make the node to match.
using NodePtr = decltype(torch::autograd::Edge().function);
template <typename N, typename P>
struct NodeMaker;
template <typename N>
struct NodeMaker<N, std::shared_ptr<Node>> {
  template <typename... A>
  static std::shared_ptr<N> make(A&&... a) {
    return std::shared_ptr<N>(new N(std::forward<A>(a)...), [](N* n) { deleteNode(n); });  // ADL: torch::autograd
  }
};
template <typename N>
struct NodeMaker<N, c10::intrusive_ptr<Node>> {
  template <typename... A>
  static c10::intrusive_ptr<N> make(A&&... a) {
    return c10::make_intrusive<N>(std::forward<A>(a)...);
  }
};

struct LnModulateBackward : public Node {
  SavedVariable x_, mean_, rstd_, scale_, weight_, bias_;
  at::ScalarType shift_dtype_ = at::kFloat;
  bool has_weight_ = false, has_bias_ = false;

  std::string name() const override { return "LnModulateBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (SavedVariable* v : {&x_, &mean_, &rstd_, &scale_, &weight_, &bias_}) v->reset_data();
  }

  // grads: {dy}; returns the gradients of (x, shift, scale, weight, bias), the node's next edges.
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    Tensor dy = grads[0];
    if (!dy.defined()) return variable_list(5);
    const Tensor x = x_.unpack();
    const Tensor scale = scale_.unpack();
    const optional<Tensor> weight = has_weight_ ? optional<Tensor>(weight_.unpack()) : std::nullopt;
    const optional<Tensor> bias = has_bias_ ? optional<Tensor>(bias_.unpack()) : std::nullopt;
    // The kernels read dy through (b, s) strides; a non-unit last-dim stride (e.g. the stride-0
    // expand of a scalar's gradient) is copied first.
    if (dy.sym_size(2) != 1 && dy.sym_stride(2) != 1) dy = dy.contiguous();
    const bool per_token = scale.sym_size(1) != 1;
    const bool alias_dshift = per_token && shift_dtype_ == dy.scalar_type();
    // The backward op is not differentiable: called below the Autograd key (no not-implemented
    // fallback walking its arguments per call). With create_graph (grad mode on here) its outputs get
    // an Error node, so that differentiating them again raises instead of silently giving zeros.
    const bool create_graph = at::GradMode::is_enabled();
    variable_list out(5);
    {
      at::AutoDispatchBelowADInplaceOrView below_ad;
      auto [dx, dshift, dscale, dweight, dbias] =
          bwd_op().call(dy, x, mean_.unpack(), rstd_.unpack(), scale, weight, bias, per_token && !alias_dshift);
      if (alias_dshift) dshift = create_graph ? dy.clone() : dy;  // with create_graph: its own history
      if (task_should_compute_output(0)) out[0] = dx;
      if (task_should_compute_output(1)) out[1] = dshift;
      if (task_should_compute_output(2)) out[2] = dscale;
      if (has_weight_ && task_should_compute_output(3)) out[3] = dweight;
      if (has_bias_ && task_should_compute_output(4)) out[4] = dbias;
    }
    if (create_graph) {
      auto err = NodeMaker<torch::autograd::Error, NodePtr>::make(
          "ds_adaptive::ln_modulate: double backward (differentiating its gradients) is not implemented",
          torch::autograd::collect_next_edges(dy, x, scale));
      for (const Tensor& g : out)
        if (g.defined()) torch::autograd::set_history(g, err);
    }
    return out;
  }
};

FwdOut ln_modulate_autograd(const Tensor& x, const Tensor& shift, const Tensor& scale, const optional<Tensor>& weight,
                            const optional<Tensor>& bias, double eps) {
  const bool requires_grad = torch::autograd::compute_requires_grad(x, shift, scale, weight, bias);
  auto out = [&] {
    at::AutoDispatchBelowADInplaceOrView guard;
    return fwd_op().call(x, shift, scale, weight, bias, eps);
  }();
  if (!requires_grad) return out;
  auto node = NodeMaker<LnModulateBackward, NodePtr>::make();
  node->set_next_edges(torch::autograd::collect_next_edges(x, shift, scale, weight, bias));
  node->x_ = SavedVariable(x, false);
  node->mean_ = SavedVariable(std::get<1>(out), false);
  node->rstd_ = SavedVariable(std::get<2>(out), false);
  node->scale_ = SavedVariable(scale, false);
  node->has_weight_ = weight.has_value();
  node->has_bias_ = bias.has_value();
  if (node->has_weight_) node->weight_ = SavedVariable(*weight, false);
  if (node->has_bias_) node->bias_ = SavedVariable(*bias, false);
  node->shift_dtype_ = shift.scalar_type();
  torch::autograd::set_history(std::get<0>(out), node);
  return out;
}

// ------------------------------------------------------------------------------------------------
// Public composite entry point (CompositeImplicitAutograd: autograd records the layout ops, the
// fused op's own Function does the rest).
// ------------------------------------------------------------------------------------------------
Tensor to_modulation_layout(const Tensor& m, const c10::SymInt& B, const c10::SymInt& rows, const c10::SymInt& D,
                            at::ScalarType dtype) {
  Tensor t = m.dim() == 2 ? m.unsqueeze(1) : m;
  if (t.scalar_type() != dtype) t = t.to(dtype);
  if (!(t.sym_size(0) == B && t.sym_size(1) == rows)) t = t.expand_symint({B, rows, D});  // stride-0 views
  if (D != 1 && t.sym_stride(2) != 1) t = t.contiguous();
  return t;
}

Tensor ln_modulate_apply(const Tensor& x_in, const Tensor& shift, const Tensor& scale, double eps,
                         const optional<Tensor>& weight, const optional<Tensor>& bias) {
  check_apply_args(x_in, shift, scale, weight, bias);
  const c10::SymInt& B = x_in.sym_size(0);
  const c10::SymInt& D = x_in.sym_size(2);
  // One modulation dtype: fp32, or x's when both already are.
  const at::ScalarType sdt = shift.scalar_type(), cdt = scale.scalar_type();
  const at::ScalarType mdt =
      (sdt == cdt && (cdt == at::kFloat || cdt == x_in.scalar_type())) ? cdt : at::kFloat;
  // One modulation layout: per-token when either is, per-sample otherwise.
  const bool tok = (shift.dim() == 3 && shift.sym_size(1) != 1) || (scale.dim() == 3 && scale.sym_size(1) != 1);
  const c10::SymInt rows = tok ? x_in.sym_size(1) : c10::SymInt(1);
  const Tensor sh = to_modulation_layout(shift, B, rows, D, mdt);
  const Tensor sc = to_modulation_layout(scale, B, rows, D, mdt);
  const Tensor x = (D != 1 && x_in.sym_stride(2) != 1) ? x_in.contiguous() : x_in;
  optional<Tensor> w, b;  // in the statistics dtype (fp32; fp64 for fp64 x)
  const at::ScalarType adt = stats_dtype(x_in);
  if (weight.has_value()) w = weight->to(adt).contiguous();
  if (bias.has_value()) {
    b = bias->to(adt).contiguous();
    if (!w.has_value()) w = at::ones_symint({D}, b->options());
  }
  return std::get<0>(fwd_op().call(x, sh, sc, w, b, eps));
}

// ------------------------------------------------------------------------------------------------
// CPU implementation: the kernels' math in ATen (statistics and modulation in fp32, one rounding;
// fp64 inputs in fp64). Also the reference the GPU tests compare the kernels with.
// ------------------------------------------------------------------------------------------------
FwdOut ln_modulate_cpu(const Tensor& x, const Tensor& shift, const Tensor& scale, const optional<Tensor>& weight,
                       const optional<Tensor>& bias, double eps) {
  check_op_args(x, shift, scale, weight, bias);
  const at::ScalarType cdt = stats_dtype(x);
  const Tensor xf = x.to(cdt);
  optional<Tensor> wf, bf;
  if (weight.has_value()) wf = weight->to(cdt);
  if (bias.has_value()) bf = bias->to(cdt);
  Tensor y = at::layer_norm(xf, {x.size(2)}, wf, bf, eps);
  y = (y * (scale.to(cdt) + 1) + shift.to(cdt)).to(x.scalar_type());
  auto [var, mean] = at::var_mean(xf, at::IntArrayRef{-1}, /*correction=*/at::Scalar(0), /*keepdim=*/false);
  Tensor rstd = at::rsqrt(var + eps);
  return {y, mean, rstd};
}

BwdOut ln_modulate_backward_cpu(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                                const Tensor& scale, const optional<Tensor>& weight, const optional<Tensor>& bias,
                                bool need_dshift) {
  check_op_args(x, scale, scale, weight, bias);
  TORCH_CHECK(dy.sizes() == x.sizes(), "ln_modulate: dy must match x ", x.sizes(), ", got ", dy.sizes());
  const at::ScalarType cdt = stats_dtype(x);
  const Tensor dyf = dy.to(cdt), xf = x.to(cdt);
  const Tensor xhat = (xf - mean.unsqueeze(-1).to(cdt)) * rstd.unsqueeze(-1).to(cdt);
  Tensor ln = xhat;
  if (weight.has_value()) {
    ln = xhat * weight->to(cdt);
    if (bias.has_value()) ln = ln + bias->to(cdt);
  }
  const Tensor dln = dyf * (scale.to(cdt) + 1);
  const Tensor g = weight.has_value() ? dln * weight->to(cdt) : dln;
  const double d = static_cast<double>(x.size(2));
  const Tensor dx = rstd.unsqueeze(-1).to(cdt) *
                    (g - g.sum(-1, true) / d - xhat * ((g * xhat).sum(-1, true) / d));
  Tensor dshift, dscale;
  if (scale.size(1) == 1) {  // per-sample: reduce over s within each sample
    dshift = dyf.sum(1, true).to(scale.scalar_type());
    dscale = (dyf * ln).sum(1, true).to(scale.scalar_type());
  } else {
    dshift = need_dshift ? dyf.to(scale.scalar_type(), false, /*copy=*/true) : at::empty({0}, scale.options());
    dscale = (dyf * ln).to(scale.scalar_type());
  }
  const auto f32 = x.options().dtype(at::kFloat);
  Tensor dweight = weight.has_value() ? (dln * xhat).sum(at::IntArrayRef{0, 1}).to(weight->scalar_type()) : at::empty({0}, f32);
  Tensor dbias = bias.has_value() ? dln.sum(at::IntArrayRef{0, 1}).to(bias->scalar_type()) : at::empty({0}, f32);
  return {dx.to(x.scalar_type()), dshift, dscale, dweight, dbias};
}

// ------------------------------------------------------------------------------------------------
// Meta implementations (shapes, dtypes, contiguous strides of every backend's outputs)
// ------------------------------------------------------------------------------------------------
FwdOut ln_modulate_meta(const Tensor& x, const Tensor& shift, const Tensor& scale, const optional<Tensor>& weight,
                        const optional<Tensor>& bias, double eps) {
  check_op_args(x, shift, scale, weight, bias);
  const auto stats = x.options().dtype(stats_dtype(x));
  return {at::empty_symint(x.sym_sizes(), x.options()), at::empty_symint({x.sym_size(0), x.sym_size(1)}, stats),
          at::empty_symint({x.sym_size(0), x.sym_size(1)}, stats)};
}

BwdOut ln_modulate_backward_meta(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                                 const Tensor& scale, const optional<Tensor>& weight, const optional<Tensor>& bias,
                                 bool need_dshift) {
  const c10::SymInt& B = x.sym_size(0);
  const c10::SymInt& S = x.sym_size(1);
  const c10::SymInt& D = x.sym_size(2);
  Tensor dshift, dscale;
  if (scale.sym_size(1) == 1) {
    dshift = at::empty_symint({B, 1, D}, scale.options());
    dscale = at::empty_symint({B, 1, D}, scale.options());
  } else {
    dshift = need_dshift ? at::empty_symint({B, S, D}, scale.options()) : at::empty({0}, scale.options());
    dscale = at::empty_symint({B, S, D}, scale.options());
  }
  const auto f32 = x.options().dtype(at::kFloat);
  Tensor dweight = weight.has_value() ? at::empty_symint({D}, weight->options()) : at::empty({0}, f32);
  Tensor dbias = bias.has_value() ? at::empty_symint({D}, bias->options()) : at::empty({0}, f32);
  return {at::empty_symint(x.sym_sizes(), x.options()), dshift, dscale, dweight, dbias};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ds_adaptive, m) {
  m.def("ln_modulate_apply(Tensor x, Tensor shift, Tensor scale, float eps=1e-06, Tensor? weight=None, "
        "Tensor? bias=None) -> Tensor");
  m.def("ln_modulate(Tensor x, Tensor shift, Tensor scale, Tensor? weight, Tensor? bias, float eps) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("ln_modulate_backward(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor scale, Tensor? weight, "
        "Tensor? bias, bool need_dshift) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ds_adaptive, CompositeImplicitAutograd, m) { m.impl("ln_modulate_apply", &ln_modulate_apply); }

TORCH_LIBRARY_IMPL(ds_adaptive, Autograd, m) { m.impl("ln_modulate", &ln_modulate_autograd); }

TORCH_LIBRARY_IMPL(ds_adaptive, CPU, m) {
  m.impl("ln_modulate", &ln_modulate_cpu);
  m.impl("ln_modulate_backward", &ln_modulate_backward_cpu);
}

TORCH_LIBRARY_IMPL(ds_adaptive, Meta, m) {
  m.impl("ln_modulate", &ln_modulate_meta);
  m.impl("ln_modulate_backward", &ln_modulate_backward_meta);
}
