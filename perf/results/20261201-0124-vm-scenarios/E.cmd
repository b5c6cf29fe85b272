== scenario E: pinq bench --producers 2 --broker-cpus 0 --consumers 2 --size 100 --warmup 0s --duration 10s --rate 100000 --delay-mix 1s:1,2s:1,3s:1,4s:1,5s:1,6s:1,7s:1,8s:1,9s:1,10s:1
