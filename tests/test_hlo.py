"""The HLO reader on text in the forms the GPU backend prints (async pairs, iota groups)."""

from zero_jax.hlo import collectives

GPU_LIKE = """\
HloModule jit_step, entry_computation_layout={()->()}

%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

%body (p: (s32[], bf16[8,64])) -> (s32[], bf16[8,64]) {
  %ags = (bf16[16,64]{1,0}, bf16[64,64]{1,0}) all-gather-start(bf16[16,64]{1,0} %w), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %agd = bf16[64,64]{1,0} all-gather-done(%ags)
  %rs = f32[16,64]{1,0} reduce-scatter(f32[64,64]{1,0} %g), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
}

%cond (p: (s32[], bf16[8,64])) -> pred[] {
  ROOT %lt = pred[] compare(s32[] %i, s32[] %n), direction=LT
}

ENTRY %main (a: f32[1024]) -> f32[1024] {
  %w = (s32[], bf16[8,64]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"12"}}
  %ars = (f32[1024]{0}, f32[10]{0}) all-reduce-start(f32[1024]{0} %a, f32[10]{0} %b), channel_id=1, replica_groups=[1,8]<=[8], to_apply=%add
  ROOT %ard = f32[1024]{0} all-reduce-done(%ars)
}
"""


def test_reads_async_collectives_loops_and_groups():
    found = {c.kind: c for c in collectives(GPU_LIKE, n_devices=8)}
    assert set(found) == {"all-gather", "reduce-scatter", "all-reduce"}
    ag, rs, ar = found["all-gather"], found["reduce-scatter"], found["all-reduce"]
    # all-gather-start's shape is (operand, result): the payload is the gathered result.
    assert (ag.dtype, ag.bytes, ag.group_size, ag.in_loop, ag.count) == ("bf16", 64 * 64 * 2, 4,
                                                                        True, 12)
    # reduce-scatter's shape is its scattered result: the payload is the full input.
    assert (rs.bytes, rs.group_size, rs.in_loop, rs.count) == (16 * 64 * 4 * 4, 4, True, 12)
    # A combined all-reduce counts all its operands, twice in ZeRO's volume.
    assert (ar.bytes, ar.group_size, ar.in_loop, ar.count) == ((1024 + 10) * 4, 8, False, 1)
    assert ar.volume == 2 * ar.bytes


def test_reads_which_devices_a_group_holds():
    # [4,2]<=[2,4]T(1,0): ids 0..7 as 2 x 4, transposed, cut into pairs: {0,4}, {1,5}, ...
    text = GPU_LIKE.replace("replica_groups=[2,4]<=[8]", "replica_groups=[4,2]<=[2,4]T(1,0)")
    found = {c.kind: c for c in collectives(text, n_devices=8)}
    assert found["all-gather"].group == (0, 4)
    assert found["reduce-scatter"].group == (0, 1, 2, 3)
    assert found["all-reduce"].group == tuple(range(8))


def test_reads_the_payload_of_every_async_start_from_its_operands():
    # GPU prints async starts with tuple shapes that differ per kind (operands, results and
    # scalar context); the payload is read from the operands, as for the synchronous forms.
    body = """\
  %rss = ((f32[64,64]{1,0}), f32[16,64]{1,0}) reduce-scatter-start(f32[64,64]{1,0} %g), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
  %rsd = f32[16,64]{1,0} reduce-scatter-done(%rss)
  %aas = ((s8[8,128]{1,0}), s8[8,128]{1,0}) all-to-all-start(s8[8,128]{1,0} %q), channel_id=5, replica_groups=[1,8]<=[8], dimensions={0}
  %aad = s8[8,128]{1,0} all-to-all-done(%aas)
  %cps = (f32[32]{0}, f32[32]{0}, u32[], u32[]) collective-permute-start(f32[32]{0} %x), channel_id=6, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[32]{0} collective-permute-done(%cps)
"""
    text = GPU_LIKE.replace("ENTRY %main (a: f32[1024]) -> f32[1024] {\n",
                            "ENTRY %main (a: f32[1024]) -> f32[1024] {\n" + body)
    found = {c.kind: c for c in collectives(text, n_devices=8) if not c.in_loop}
    assert found["reduce-scatter"].bytes == 64 * 64 * 4  # the full input, once
    assert (found["all-to-all"].dtype, found["all-to-all"].bytes) == ("s8", 8 * 128)
    assert found["collective-permute"].bytes == 32 * 4
