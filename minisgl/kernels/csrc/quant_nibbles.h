// Nibble unpacking written over a traits struct's own primitives (set1, add, sub, mul, cvt_u8,
// shr_mask, VL): the AVX2 and portable traits share it. It is included *inside* each struct V's
// body, so its member templates are compiled under that translation unit's target pragma like
// the rest of the struct. (AVX-512 has its own nibbles: a 16-entry vpermps table per block.)
// No include guard: one copy per struct.
template <int MAP> static inline F nib_map(F q, F d, F m) {
  if (MAP == NIB_MUL_ADD) return add(mul(d, q), m);
  if (MAP == NIB_MUL_SUB) return sub(mul(d, q), m);
  return mul(d, sub(q, set1(8.f)));
}
template <int MAP> static inline void nibbles(I q, float d, float m, F* lo, F* hi) {
  const F dv = set1(d), mv = set1(m);
  cvt_u8(shr_mask(q, 0, 0x0F), lo);
  cvt_u8(shr_mask(q, 4, 0x0F), hi);
  for (int v = 0; v < 16 / VL; ++v) lo[v] = nib_map<MAP>(lo[v], dv, mv), hi[v] = nib_map<MAP>(hi[v], dv, mv);
}
template <int MAP> static inline void nibbles_sel(I q, int high, float d, float m, F* out) {
  const F dv = set1(d), mv = set1(m);
  cvt_u8(shr_mask(q, high ? 4 : 0, 0x0F), out);
  for (int v = 0; v < 16 / VL; ++v) out[v] = nib_map<MAP>(out[v], dv, mv);
}
