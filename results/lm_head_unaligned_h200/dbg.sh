set +e
run() { timeout 120 python results/lm_head_unaligned_h200/dbg.py "$1" 2>&1 | grep RESULT; }
run '{"fn":"bias_gelu","shapes":[[256,128],[128,304],[304]]}'
run '{"fn":"bias_gelu","shapes":[[256,128],[128,301],[301]],"no_rows":1}'
run '{"fn":"bias_gelu","shapes":[[256,128],[128,301],[301]]}'
run '{"fn":"bias_gelu","shapes":[[256,128],[128,301],[301]],"cfg":{"pingpong":0,"block_n":64,"block_k":64,"max_concurrent_steps":2}}'
run '{"fn":"plain","shapes":[[256,128],[128,301]],"cfg":{"pingpong":0,"block_n":64,"block_k":64,"max_concurrent_steps":2}}'
run '{"fn":"lm","shapes":[[1024,1024],[50304,1024]]}'
run '{"fn":"lm","shapes":[[1024,1024],[50257,1024]],"no_rows":1}'
run '{"fn":"lm","shapes":[[1024,1024],[50257,1024]]}'
which compute-sanitizer && timeout 200 compute-sanitizer --print-limit 5 python results/lm_head_unaligned_h200/dbg.py '{"fn":"bias_gelu","shapes":[[256,128],[128,301],[301]]}' 2>&1 | grep -v "^\s*$" | head -40
