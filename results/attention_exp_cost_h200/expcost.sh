for D in 64 128; do for v in base poly free; do timeout 150 python results/attention_exp_cost_h200/expcost.py $v $D 2>&1 | grep RESULT; done; done
for v in base poly free; do timeout 150 python results/attention_exp_cost_h200/expcost.py $v 64 causal 2>&1 | grep RESULT; done
