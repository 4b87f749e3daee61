run() { timeout 120 python results/lm_head_unaligned_h200/diag.py "$1" 2>&1 | grep RESULT; }
run '{"shapes":[[1024,1024],[50257,1024]]}'
run '{"shapes":[[1000,1024],[50257,1024]]}'
run '{"shapes":[[256,128],[301,128]]}'
run '{"shapes":[[200,1024],[301,1024]],"cfg":{"pingpong":0,"wg_dimension":1,"block_n":64,"block_k":64,"max_concurrent_steps":2}}'
run '{"shapes":[[200,1024],[301,1024]],"cfg":{"pingpong":0,"epilogue_wg":1,"block_k":64,"max_concurrent_steps":2}}'
